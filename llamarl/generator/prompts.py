"""The prompt stream of one generator engine: its shard of the training prompts, in a shuffled
order that is a pure function of (seed, epoch), so a run is reproducible and resumable."""

from __future__ import annotations

import random
from dataclasses import dataclass

from llamarl.tiny import task as tasks

TRAIN_POOL = 50_000  # distinct training prompts generated for the synthetic task


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str
    answer: str


def task_examples(task: str, split: str, n: int, seed: int) -> list[tasks.Example]:
    if task != "reverse":
        raise ValueError(f"data.task {task!r} is unknown: the embedded task is 'reverse'")
    return tasks.sample_examples(n, split, seed)


def encode(tokenizer, example: tasks.Example) -> Prompt:
    ids = [tokenizer.bos_token_id] + tokenizer.encode(example.prompt, add_special_tokens=False)
    return Prompt(ids, example.prompt, example.answer)


class PromptStream:
    def __init__(self, prompts: list[Prompt], shard: int, shards: int, seed: int):
        self.prompts = prompts[shard::shards]
        if not self.prompts:
            raise ValueError(f"engine {shard} got no prompts: the dataset has {len(prompts)} "
                             f"prompts for {shards} engines")
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
        return order

    def next(self, n: int) -> list[Prompt]:
        out = []
        while len(out) < n:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle()
            out.append(self.prompts[self._order[self.index]])
            self.index += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}
