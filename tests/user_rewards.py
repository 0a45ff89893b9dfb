"""User reward functions for the tests, named `user_rewards:NAME` in a recipe."""


def length_bonus(completion: str, answer: str, prompt: str) -> float:
    return min(1.0, len(completion) / max(1, len(answer)))


def broken(completion: str, answer: str, prompt: str) -> float:
    raise ZeroDivisionError("this reward function is broken on purpose")
