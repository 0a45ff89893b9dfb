"""The embedded synthetic task: reverse a short string of letters.

A prompt is `<bos>abcd=` and the correct completion is `dcba<eos>`. The reward is verifiable and
dense enough for a tiny model to learn from: the fraction of target characters that are right, in
place, penalised by extra characters (so a long ramble never scores 1).

    reward = (# positions i with out[i] == target[i]) / max(len(target), len(out))   in [0, 1]

Train and held-out prompts are disjoint: a string goes to the held-out split when a hash of it
falls in the held-out bucket, so no held-out prompt is ever trained on.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

ALPHABET = "abcdefghijkl"
MIN_LEN, MAX_LEN = 3, 6
SEPARATOR = "="
HELD_OUT_PERCENT = 10


@dataclass(frozen=True)
class Example:
    prompt: str  # text fed to the model, without the BOS token
    answer: str  # the verifiable target completion
    # the whole dataset row, for multi-turn environments (rollout.env); None: {prompt, answer}
    row: dict | None = field(default=None, compare=False, hash=False)


def _held_out(s: str) -> bool:
    return int(hashlib.sha1(s.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def make_example(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(MIN_LEN, MAX_LEN)
    s = "".join(rng.choice(ALPHABET) for _ in range(n))
    return s, s[::-1]


def sample_examples(n: int, split: str, seed: int) -> list[Example]:
    """`n` examples of `split` ("train" or "eval"), deterministic in `seed`."""
    assert split in ("train", "eval"), split
    rng = random.Random(f"{split}:{seed}")
    out: list[Example] = []
    while len(out) < n:
        s, target = make_example(rng)
        if _held_out(s) == (split == "eval"):
            out.append(Example(prompt=s + SEPARATOR, answer=target))
    return out


def reverse_reward(completion: str, answer: str) -> float:
    """Positional match of `completion` against `answer`, normalised to [0, 1]."""
    out = completion.strip()
    if not answer:
        return float(out == "")
    hits = sum(1 for a, b in zip(out, answer) if a == b)
    return hits / max(len(answer), len(out))
