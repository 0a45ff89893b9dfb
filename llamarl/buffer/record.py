"""The rollout record: one token sequence per sample with per-token columns, stored columnar,
so a batch of B samples is a handful of flat tensors.

A sample is its whole sequence: the prompt, then every turn (what the policy sampled, and for
multi-turn episodes the tool or environment output and template glue between turns). Per token
(L = total tokens of the batch, samples concatenated in order):

    token_ids      [L] int32    the sequence exactly as the engine saw it
    loss_mask      [L] uint8    1 on tokens the policy sampled, 0 on the prompt, observations
                                and glue: the trainer's loss reads only the 1s
    logprobs       [L] float32  behaviour logprob of a sampled token, after temperature (0
                                where loss_mask is 0)
    token_version  [L] int64    policy version that sampled the token (-1 where loss_mask is 0)

Per sample [B]:

    seq_lens       int32    tokens of the sample (sum = L)
    prompt_lens    int32    tokens before the first sampled one (the first prompt)
    rewards        float32  total (weighted) reward
    group_ids      int64    samples of one prompt share a group id and travel together
    finish         uint8    why the sample ended: FINISH_REASONS[code]
    turns          int32    assistant turns (1 for single-turn sampling)
    policy_version int64    oldest version among its sampled tokens (staleness is measured
                            from it)
    generator      int32    engine index that made it

plus `info`, a small JSON-able dict of per-batch measurements (generation time, ...).
Columnar layout means a batch crosses processes as a few memcpys, with no pickling, and every
operation below (select, split, pad) is index arithmetic on the flat tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from itertools import chain

import torch

# Finish reasons: "stop" = the policy ended with EOS (the last turn, for an episode);
# "length" = a turn hit max_new_tokens; "max_turns" / "context" = an episode hit
# max_turns / the total token budget; "env_error" = the environment or a tool failed and
# rollout.on_error = zero ended the episode.
FINISH_REASONS = ("length", "stop", "max_turns", "context", "env_error")
FINISH_CODE = {name: code for code, name in enumerate(FINISH_REASONS)}

TOKEN_COLUMNS = {"token_ids": torch.int32, "loss_mask": torch.uint8,
                 "logprobs": torch.float32, "token_version": torch.int64}
SAMPLE_COLUMNS = {"seq_lens": torch.int32, "prompt_lens": torch.int32,
                  "rewards": torch.float32, "group_ids": torch.int64, "finish": torch.uint8,
                  "turns": torch.int32, "policy_version": torch.int64,
                  "generator": torch.int32}
_COLUMNS = {**TOKEN_COLUMNS, **SAMPLE_COLUMNS}


@dataclass
class Sample:
    """One sample under construction, appended segment by segment: the tokens, the sampled
    tokens' logprobs, and per segment its length and the policy version that sampled it (-1:
    context). Per-token columns are expanded from the segments in from_samples, so the engine's
    outputs (lists) cross into tensors once, with no per-token Python work beyond the ids and
    logprobs themselves."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of the sampled tokens only
    segments: list[int] = field(default_factory=list)  # tokens per segment
    versions: list[int] = field(default_factory=list)  # per segment; -1 = not sampled
    prompt_len: int = 0
    turns: int = 0
    finish: str = "length"  # a FINISH_REASONS name, set when the sample ends

    def add_context(self, ids) -> None:
        """Tokens the policy did not sample (prompt, observation, template glue)."""
        self.token_ids.extend(ids)
        self.segments.append(len(ids))
        self.versions.append(-1)
        if self.turns == 0:
            self.prompt_len = len(self.token_ids)

    def add_sampled(self, ids, logprobs, version: int, new_turn: bool = True) -> None:
        """One assistant turn, exactly as the engine sampled it; `new_turn=False`: more
        tokens of the same turn, sampled by another version (a weight load mid-turn)."""
        assert len(ids) == len(logprobs), (len(ids), len(logprobs))
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.segments.append(len(ids))
        self.versions.append(version)
        self.turns += new_turn

    def add_completion(self, c, version: int) -> None:
        """One assistant turn from an engine Completion: one segment per span of tokens
        sampled by one version (c.versions), or all by `version` when it has none."""
        spans = c.versions or [(len(c.token_ids), version)]
        at = 0
        for i, (n, v) in enumerate(spans):
            self.add_sampled(c.token_ids[at:at + n], c.logprobs[at:at + n], v, new_turn=i == 0)
            at += n


@dataclass
class RolloutBatch:
    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    token_version: torch.Tensor
    seq_lens: torch.Tensor
    prompt_lens: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    finish: torch.Tensor
    turns: torch.Tensor
    policy_version: torch.Tensor
    generator: torch.Tensor
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        for name, dtype in _COLUMNS.items():
            t = getattr(self, name)
            assert t.dtype == dtype and t.dim() == 1, (name, t.dtype, t.shape)
        b, n = len(self.seq_lens), len(self.token_ids)
        assert all(len(getattr(self, c)) == b for c in SAMPLE_COLUMNS), "sample columns"
        assert all(len(getattr(self, c)) == n for c in TOKEN_COLUMNS), "token columns"
        assert int(self.seq_lens.sum()) == n, (int(self.seq_lens.sum()), n)

    def __len__(self) -> int:
        return len(self.seq_lens)

    # -- building -------------------------------------------------------------------------
    @classmethod
    def from_samples(cls, samples: list[Sample], rewards: list[float], group_ids: list[int],
                     generator: int, info: dict | None = None) -> RolloutBatch:
        """The batch of finished `samples` (each with its FINISH_REASONS name in .finish)."""
        def flat(name, dtype):
            return torch.tensor(list(chain.from_iterable(getattr(s, name) for s in samples)),
                                dtype=dtype)

        ids = flat("token_ids", torch.int32)
        versions = torch.repeat_interleave(flat("versions", torch.int64),
                                           flat("segments", torch.int64), output_size=len(ids))
        mask = versions >= 0
        logprobs = torch.zeros(len(ids), dtype=torch.float32)
        logprobs[mask] = flat("logprobs", torch.float32)
        lens = torch.tensor([len(s.token_ids) for s in samples], dtype=torch.int32)
        return cls(
            token_ids=ids, loss_mask=mask.to(torch.uint8), logprobs=logprobs,
            token_version=versions, seq_lens=lens,
            prompt_lens=torch.tensor([s.prompt_len for s in samples], dtype=torch.int32),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            group_ids=torch.tensor(group_ids, dtype=torch.int64),
            finish=torch.tensor([FINISH_CODE[s.finish] for s in samples], dtype=torch.uint8),
            turns=torch.tensor([s.turns for s in samples], dtype=torch.int32),
            policy_version=_segment_min_sampled(versions, lens),
            generator=torch.full((len(samples),), generator, dtype=torch.int32),
            info=dict(info or {}))

    @classmethod
    def from_lists(cls, prompts: list[list[int]], completions: list[list[int]],
                   logprobs: list[list[float]], rewards: list[float], group_ids: list[int],
                   finished: list[bool], policy_version: int | list[int],
                   generator: int, info: dict | None = None) -> RolloutBatch:
        """Single-turn samples (prompt, one completion) from per-sequence lists;
        `policy_version` is one value for the batch or one per sequence."""
        versions = ([policy_version] * len(prompts) if isinstance(policy_version, int)
                    else policy_version)
        samples = []
        for p, c, lp, v, f in zip(prompts, completions, logprobs, versions, finished):
            s = Sample(finish="stop" if f else "length")
            s.add_context(p)
            s.add_sampled(c, lp, v)
            samples.append(s)
        batch = cls.from_samples(samples, rewards, group_ids, generator, info)
        batch.policy_version = torch.tensor(versions, dtype=torch.int64)  # empty completions too
        return batch

    # -- reading --------------------------------------------------------------------------
    def columns(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in _COLUMNS}

    def starts(self) -> torch.Tensor:
        """[B] int64: offset of each sample's first token in the token columns."""
        lens = self.seq_lens.long()
        return torch.cumsum(lens, 0) - lens

    def sampled_tokens(self) -> torch.Tensor:
        """[B] int64: tokens the policy sampled in each sample (the loss's tokens)."""
        return _segment_sum(self.loss_mask.long(), self.seq_lens)

    @property
    def finished(self) -> torch.Tensor:
        """[B] bool: ended by the policy (EOS), not by a limit."""
        return self.finish == FINISH_CODE["stop"]

    def rows(self) -> list[torch.Tensor]:
        """Each sample's token ids, as views (for code that must see one sample at a time)."""
        return list(self.token_ids.split(self.seq_lens.tolist()))

    # -- re-shaping -----------------------------------------------------------------------
    def select(self, rows: torch.Tensor) -> RolloutBatch:
        """The sub-batch of samples `rows` ([k] int64 indices), in that order."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        lens = self.seq_lens.long()[rows]
        tok = _gather_index(self.starts()[rows], lens)
        cols = {n: getattr(self, n)[tok] for n in TOKEN_COLUMNS}
        cols.update({n: getattr(self, n)[rows] for n in SAMPLE_COLUMNS})
        return RolloutBatch(**cols, info=dict(self.info))

    def slice(self, first: int, last: int) -> RolloutBatch:
        """Samples first..last-1 as views (no copy)."""
        starts = self.starts()
        t0 = int(starts[first]) if first < len(self) else len(self.token_ids)
        t1 = int(starts[last]) if last < len(self) else len(self.token_ids)
        cols = {n: getattr(self, n)[t0:t1] for n in TOKEN_COLUMNS}
        cols.update({n: getattr(self, n)[first:last] for n in SAMPLE_COLUMNS})
        return RolloutBatch(**cols, info=dict(self.info))

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        assert batches
        cols = {f.name: torch.cat([getattr(b, f.name) for b in batches])
                for f in fields(RolloutBatch) if f.name != "info"}
        return RolloutBatch(**cols, info={"parts": [b.info for b in batches]})


def split_groups(batch: RolloutBatch, parts: int) -> list[RolloutBatch]:
    """Split into `parts` sub-batches of the same number of whole groups, groups in order."""
    groups = len(torch.unique_consecutive(batch.group_ids))
    if groups % parts:
        raise ValueError(f"{groups} groups do not split evenly over {parts} trainer ranks")
    return split_counts(batch, [groups // parts] * parts)


def split_counts(batch: RolloutBatch, counts: list[int]) -> list[RolloutBatch]:
    """Split into sub-batches of counts[k] whole groups each, groups in order (the runs of a
    slot's batch that go to each trainer rank, parallel/shares.py). A group's samples are
    contiguous (they are made together), so every part is a slice."""
    gids, sizes = torch.unique_consecutive(batch.group_ids, return_counts=True)
    assert len(torch.unique(gids)) == len(gids), "a group's samples must be contiguous"
    if sum(counts) != len(gids):
        raise ValueError(f"{len(gids)} groups do not split into runs of {counts}")
    ends = torch.cumsum(sizes, 0).tolist()
    bounds, done = [0], 0
    for n in counts:
        done += n
        bounds.append(ends[done - 1] if done else 0)
    return [batch.slice(bounds[k], bounds[k + 1]) for k in range(len(counts))]


def episode_counts(batch: RolloutBatch) -> dict[str, float]:
    """Multi-turn counts of a batch: response tokens (everything after the prompt), the
    sampled ones among them, and the samples per finish reason (finish_<reason>)."""
    counts = torch.bincount(batch.finish.long(), minlength=len(FINISH_REASONS)).tolist()
    return {"response_tokens": float((batch.seq_lens - batch.prompt_lens).sum()),
            "sampled_tokens": float(batch.loss_mask.sum()),
            **{f"finish_{name}": float(c) for name, c in zip(FINISH_REASONS, counts)}}


def segment_ids(lens: torch.Tensor, total: int) -> torch.Tensor:
    """[total]: for each token of samples of lengths `lens` laid end to end, its sample."""
    return torch.repeat_interleave(torch.arange(len(lens)), lens.long(), output_size=total)


def segment_positions(lens: torch.Tensor, total: int) -> torch.Tensor:
    """[total]: for each token of samples of lengths `lens` laid end to end, its position in
    its sample."""
    lens = lens.long()
    return torch.arange(total) - (torch.cumsum(lens, 0) - lens)[segment_ids(lens, total)]


def _gather_index(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Token indices of samples starting at `starts` with lengths `lens`, concatenated."""
    total = int(lens.sum())
    return starts[segment_ids(lens, total)] + segment_positions(lens, total)


def _segment_sum(values: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    seg = segment_ids(lens, len(values))
    return torch.zeros(len(lens), dtype=values.dtype).index_add_(0, seg, values)


def _segment_min_sampled(versions: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Per sample, the oldest version among its sampled tokens (-1 tokens are context);
    a sample that sampled nothing gets 0."""
    seg = segment_ids(lens, len(versions))
    big = torch.iinfo(torch.int64).max
    keyed = torch.where(versions >= 0, versions, torch.full_like(versions, big))
    out = torch.full((len(lens),), big, dtype=torch.int64).scatter_reduce_(
        0, seg, keyed, reduce="amin")
    return torch.where(out == big, torch.zeros_like(out), out)
