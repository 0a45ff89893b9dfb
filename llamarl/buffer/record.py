"""Rollout records, stored columnar: a batch of B sequences is a handful of flat tensors.

Per sequence i (shapes in brackets, L_p / L_c = total prompt / completion tokens in the batch):

    prompt_ids       [L_p] int32   concatenated; prompt_lens [B] int32
    completion_ids   [L_c] int32   concatenated; completion_lens [B] int32
    logprobs         [L_c] float32 behaviour logprob of each sampled token, after temperature
    rewards          [B]   float32 total (weighted) reward
    group_ids        [B]   int64   samples of one prompt share a group id and travel together
    finished         [B]   uint8   1 = ended with EOS, 0 = hit the length limit
    policy_version   [B]   int64   version of the weights that generated the sample
    generator        [B]   int32   engine index that made it

plus `info`, a small JSON-able dict of per-batch measurements (generation time, ...).
Columnar layout means a batch crosses processes as a few memcpys, with no pickling.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

_COLUMNS = {
    "prompt_ids": torch.int32, "prompt_lens": torch.int32, "completion_ids": torch.int32,
    "completion_lens": torch.int32, "logprobs": torch.float32, "rewards": torch.float32,
    "group_ids": torch.int64, "finished": torch.uint8, "policy_version": torch.int64,
    "generator": torch.int32,
}


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor
    prompt_lens: torch.Tensor
    completion_ids: torch.Tensor
    completion_lens: torch.Tensor
    logprobs: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    finished: torch.Tensor
    policy_version: torch.Tensor
    generator: torch.Tensor
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        for name, dtype in _COLUMNS.items():
            t = getattr(self, name)
            assert t.dtype == dtype and t.dim() == 1, (name, t.dtype, t.shape)
        b = len(self.prompt_lens)
        assert all(len(getattr(self, n)) == b for n in ("completion_lens", "rewards", "group_ids",
                                                        "finished", "policy_version", "generator"))
        assert int(self.prompt_lens.sum()) == len(self.prompt_ids)
        assert int(self.completion_lens.sum()) == len(self.completion_ids) == len(self.logprobs)

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @classmethod
    def from_lists(cls, prompts: list[list[int]], completions: list[list[int]],
                   logprobs: list[list[float]], rewards: list[float], group_ids: list[int],
                   finished: list[bool], policy_version: int | list[int],
                   generator: int | list[int], info: dict | None = None) -> RolloutBatch:
        """Build from per-sequence lists; `policy_version` and `generator` are one value for
        the whole batch or one per sequence."""
        b = len(prompts)

        def per_row(value, dtype):
            if isinstance(value, int):
                return torch.full((b,), value, dtype=dtype)
            return torch.tensor(value, dtype=dtype)

        def flat(rows, dtype):
            return torch.tensor([x for r in rows for x in r], dtype=dtype)

        return cls(
            prompt_ids=flat(prompts, torch.int32),
            prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int32),
            completion_ids=flat(completions, torch.int32),
            completion_lens=torch.tensor([len(c) for c in completions], dtype=torch.int32),
            logprobs=flat(logprobs, torch.float32),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            group_ids=torch.tensor(group_ids, dtype=torch.int64),
            finished=torch.tensor(finished, dtype=torch.uint8),
            policy_version=per_row(policy_version, torch.int64),
            generator=per_row(generator, torch.int32),
            info=dict(info or {}))

    def columns(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in _COLUMNS}

    def sequences(self) -> list[tuple[list[int], list[int], list[float]]]:
        """Per sequence: (prompt ids, completion ids, behaviour logprobs) as lists."""
        p_off = torch.cumsum(self.prompt_lens, 0).tolist()
        c_off = torch.cumsum(self.completion_lens, 0).tolist()
        out, p0, c0 = [], 0, 0
        pid, cid = self.prompt_ids.tolist(), self.completion_ids.tolist()
        lp = self.logprobs.tolist()
        for p1, c1 in zip(p_off, c_off):
            out.append((pid[p0:p1], cid[c0:c1], lp[c0:c1]))
            p0, c0 = p1, c1
        return out

    def select(self, rows: list[int]) -> RolloutBatch:
        """The sub-batch of sequences `rows`, in that order."""
        seqs = self.sequences()
        return RolloutBatch.from_lists(
            [seqs[i][0] for i in rows], [seqs[i][1] for i in rows], [seqs[i][2] for i in rows],
            self.rewards[rows].tolist(), self.group_ids[rows].tolist(),
            [bool(x) for x in self.finished[rows].tolist()],
            self.policy_version[rows].tolist(), self.generator[rows].tolist(), dict(self.info))

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        assert batches
        cols = {f.name: torch.cat([getattr(b, f.name) for b in batches])
                for f in fields(RolloutBatch) if f.name != "info"}
        return RolloutBatch(**cols, info={"parts": [b.info for b in batches]})


def split_groups(batch: RolloutBatch, parts: int) -> list[RolloutBatch]:
    """Split into `parts` sub-batches of whole groups, as even as possible, groups in order."""
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(batch.group_ids.tolist()):
        groups.setdefault(g, []).append(i)
    ordered = list(groups.values())
    if len(ordered) % parts:
        raise ValueError(f"{len(ordered)} groups do not split evenly over {parts} trainer ranks")
    per = len(ordered) // parts
    return [batch.select([i for grp in ordered[k * per:(k + 1) * per] for i in grp])
            for k in range(parts)]
