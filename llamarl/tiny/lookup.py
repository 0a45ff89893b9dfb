"""The embedded multi-turn task: answer with values that only a tool can reveal.

Each episode has its own hidden table mapping the keys a..l to digits. The prompt asks for the
values of 2-3 keys; the answer is their digits in order. The table is not in the prompt, so a
policy that does not call the `lookup(key)` tool can only guess (1 in 10 per digit).

    prompt   <bos>ab=                 keys a and b
    turn 1   *a<eos>                  tool call, compact format: "*key"
    obs 1    3=                       the tool's result, then "=" (your turn)
    turn 2   *b<eos>
    obs 2    7=
    turn 3   37<eos>                  the final answer (no "*"): reward 1.0

    reward = (# positions i with answer[i] == target[i]) / max(len(target), len(answer))

A malformed call or an unknown key shows "-=" (counted as malformed or a tool error).
Train and held-out queries are disjoint (by a hash of the query, as for the reverse task).
"""

from __future__ import annotations

import hashlib
import random

from llamarl.tiny.task import Example

KEYS = "abcdefghijkl"
MIN_KEYS, MAX_KEYS = 2, 3
SEPARATOR = "="
CALL = "*"
HELD_OUT_PERCENT = 10


def _held_out(query: str) -> bool:
    return int(hashlib.sha1(f"lookup:{query}".encode()).hexdigest(), 16) % 100 \
        < HELD_OUT_PERCENT


def make_row(rng: random.Random) -> dict:
    query = "".join(rng.sample(KEYS, rng.randint(MIN_KEYS, MAX_KEYS)))
    table = "".join(str(rng.randrange(10)) for _ in KEYS)
    answer = "".join(table[KEYS.index(k)] for k in query)
    return {"prompt": query + SEPARATOR, "answer": answer, "table": table}


def sample_examples(n: int, split: str, seed: int) -> list[Example]:
    """`n` episodes of `split` ("train" or "eval"), deterministic in `seed`."""
    assert split in ("train", "eval"), split
    rng = random.Random(f"lookup:{split}:{seed}")
    out: list[Example] = []
    while len(out) < n:
        row = make_row(rng)
        if _held_out(row["prompt"][:-1]) == (split == "eval"):
            out.append(Example(prompt=row["prompt"], answer=row["answer"], row=row))
    return out


def lookup_reward(answer: str, target: str) -> float:
    out = answer.strip()
    if out.startswith(CALL):
        return 0.0
    hits = sum(1 for a, b in zip(out, target) if a == b)
    return hits / max(len(target), len(out))


def transcript(row: dict, use_tool: bool, rng: random.Random) -> list[tuple[str, str]]:
    """A warm-start episode as (kind, text) segments, kind "context" or "turn" (each turn
    ends with EOS). With the tool: one call per key, then the right answer; without: a
    guess of the right length."""
    query = row["prompt"][:-1]
    segments = [("context", row["prompt"])]
    if use_tool:
        for k in query:
            segments.append(("turn", CALL + k))
            segments.append(("context", row["table"][KEYS.index(k)] + SEPARATOR))
        segments.append(("turn", row["answer"]))
    else:
        segments.append(("turn", "".join(str(rng.randrange(10)) for _ in query)))
    return segments
