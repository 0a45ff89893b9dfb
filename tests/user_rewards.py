"""User reward functions for the tests, named `user_rewards:NAME` in a recipe."""


def length_bonus(completion: str, answer: str, prompt: str) -> float:
    return min(1.0, len(completion) / max(1, len(answer)))


def broken(completion: str, answer: str, prompt: str) -> float:
    raise ZeroDivisionError("this reward function is broken on purpose")


def sleepy(completion: str, answer: str, prompt: str) -> float:
    """Hangs (in time.sleep) on completions starting with 's'."""
    import time

    if completion.startswith("s"):
        time.sleep(60)
    return 1.0


def stubborn(completion: str, answer: str, prompt: str) -> float:
    """Ignores the worker's soft timeout on completions starting with 's': only a kill stops
    it."""
    import time

    if completion.startswith("s"):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                time.sleep(0.05)
            except BaseException:  # noqa: BLE001 - swallowing the timeout on purpose
                pass
    return 2.0


def crashes(completion: str, answer: str, prompt: str) -> float:
    """Kills its own process on completions starting with 'x'."""
    import os

    if completion.startswith("x"):
        os._exit(3)
    return 3.0


def not_a_number(completion: str, answer: str, prompt: str):
    return None if completion.startswith("n") else 0.5


_calls = 0  # per worker process


def flaky(completion: str, answer: str, prompt: str) -> float:
    """For the end-to-end test: of every 50 calls, 7 raise and 1 hangs (deterministic counts,
    whatever the policy writes)."""
    import time

    global _calls
    _calls += 1
    if _calls % 50 == 10:
        time.sleep(60)
    if _calls % 7 == 3:
        raise ValueError("flaky on purpose")
    return 1.0


def worker_pid(completion: str, answer: str, prompt: str) -> float:
    import os

    return float(os.getpid())
