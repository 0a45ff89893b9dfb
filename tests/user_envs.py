"""Environments for the multi-turn tests (rollout.env = "user_envs:...")."""

from __future__ import annotations

import os
import random
import time

from llamarl.envs.lookup import LookupEnv
from llamarl.rollout.environment import Environment


class SlowLookupEnv(LookupEnv):
    """The lookup task with a tool that takes a random 0-50 ms (a remote call)."""

    def lookup(self, key: str) -> str:
        time.sleep(random.uniform(0.0, 0.05))
        return super().lookup(key)


class EchoEnv(Environment):
    """Two tool turns at most: the tool echoes its argument."""

    def tools(self):
        return {"echo": lambda x: x.upper(), "boom": self.boom}

    def boom(self, x):
        raise RuntimeError("tool exploded")

    def reward(self, answer: str) -> float:
        return float(len(answer))


class HangingEnv(Environment):
    def turn(self, text, tool_format):
        time.sleep(3600)

    def reward(self, answer):
        return 0.0


class CrashingEnv(Environment):
    def turn(self, text, tool_format):
        os._exit(3)

    def reward(self, answer):
        return 0.0


class CrashOnDieEnv(Environment):
    """A tool that kills its worker process when the model says "die"; other turns count
    (the observation says which turn of the episode this is)."""

    def __init__(self, row):
        super().__init__(row)
        self.turns = 0

    def turn(self, text, tool_format):
        if text == "die":
            os._exit(3)
        self.turns += 1
        return f"turn {self.turns}", {"tool_calls": 1, "tool_errors": 0, "malformed": 0}

    def reward(self, answer):
        return float(self.turns)


class SurrogateEnv(Environment):
    """An observation holding a lone surrogate (no tokenizer can encode it)."""

    def turn(self, text, tool_format):
        return "bad \ud800 text", {"tool_calls": 1, "tool_errors": 0, "malformed": 0}

    def reward(self, answer):
        return 0.0


class RaisingRewardEnv(Environment):
    def turn(self, text, tool_format):
        return None, {"tool_calls": 0, "tool_errors": 0, "malformed": 0}

    def reward(self, answer):
        raise ValueError("no reward for you")


class ThreeTurnEnv(Environment):
    """Three reversals in one episode: each observation is the next string to reverse (the
    reverse warm start answers them), the third turn ends the episode."""

    QUERIES = ["ab=", "kli="]

    def __init__(self, row):
        super().__init__(row)
        self.turns = 0

    def turn(self, text, tool_format):
        self.turns += 1
        counts = {"tool_calls": 1, "tool_errors": 0, "malformed": 0}
        if self.turns == 3:
            return None, counts
        return self.QUERIES[self.turns - 1], counts

    def reward(self, answer):
        return float(answer == "ilk")


class BrokenPromptEnv(Environment):
    def prompt(self):
        raise RuntimeError("cannot start")

    def reward(self, answer):
        return 0.0
