"""The tiny tool task's environment (llamarl/tiny/lookup.py): one tool, `lookup(key)`."""

from __future__ import annotations

from llamarl.rollout.environment import Environment
from llamarl.tiny.lookup import KEYS, SEPARATOR, lookup_reward


class LookupEnv(Environment):
    def tools(self):
        return {"lookup": self.lookup}

    def lookup(self, key: str) -> str:
        if len(key) != 1 or key not in KEYS:
            raise KeyError(f"no key {key!r}")
        return self.row["table"][KEYS.index(key)]

    def observation(self, results: list[str]) -> str:
        # the tiny vocabulary has digits, not words: an error shows as "-"
        return "".join(r if r.isdigit() else "-" for r in results) + SEPARATOR

    def reward(self, answer: str) -> float:
        return lookup_reward(answer, self.row["answer"])
