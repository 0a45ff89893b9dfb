"""The sampled tokens' logprobs read off vLLM's sampler, instead of through vLLM's logprobs
outputs (CPU engines, `Engine.generate`).

Asked for logprobs (`SamplingParams(logprobs=0)`), vLLM turns every decode step's [R, 1]
tensor of sampled-token logprobs into Python lists, slices them request by request in the
scheduler, and appends them one request at a time in its output processor: on the tiny
model, with R = 256 sequences of one token per step, that Python work was 9% of a generate
call (two engines in one process, calls alternating: 0.907x the time without it). The values
themselves come for free: in `logprobs_mode="processed_logprobs"` the sampler computes the
[R, V] log-softmax of the processed logits (after temperature) on every step, logprobs asked
for or not.

So `Engine.generate` on a CPU asks for none, and this hook takes them where vLLM makes them:
it wraps the model runner's `Sampler.sample` (which returns the sampled ids and that
log-softmax) and keeps, per step, the rows' request ids, which rows vLLM discards (a chunk of a
prefill that is not its last samples nothing) and the [R] gathered logprobs:

    logprob[r] = log_softmax(logits[r] / T_r)[sampled[r]]      (float32)

the same expression, on the same tensors, as vLLM's own `gather_logprobs`, so the values are
the same bits (tests/test_sampling.py compares every logprob of a batch with chunked prefills
and preemptions against vLLM's). An all-greedy step returns no log-softmax; there vLLM takes
it of the raw logits, and so does the hook.

`collect` then maps vLLM's internal request ids back to (request id given to vLLM, child
index): a child of an `n`-sample request is `"{index}_{request id}-{8 random chars}"`
(vllm/v1/engine/parallel_sampling.py, input_processor.assign_request_id); an id that does not
parse that way stops the call with a RuntimeError rather than mislabel a logprob.
"""

from __future__ import annotations

import torch


class SampledLogprobCapture:
    """Installed once on a vLLM model runner (`install`); records while `start`ed."""

    @classmethod
    def install(cls, runner) -> SampledLogprobCapture | None:
        """The capture on `runner`, or None where the runner lacks what it reads (another
        vLLM): the engine then asks vLLM for the logprobs as before."""
        sampler = getattr(runner, "sampler", None)
        if not all(hasattr(o, a) for o, a in ((sampler, "sample"), (runner, "input_batch"),
                                               (runner, "discard_request_mask"))):
            return None
        return cls(runner)

    def __init__(self, runner):
        self.runner = runner
        self.steps: list[tuple[list[str], object, torch.Tensor]] = []
        self.active = False
        sampler = runner.sampler
        original = sampler.sample

        def sample(logits, sampling_metadata, *args, **kwargs):
            sampled, processed = original(logits, sampling_metadata, *args, **kwargs)
            if self.active:
                self._record(logits, sampled, processed)
            return sampled, processed

        sampler.sample = sample

    def _record(self, logits: torch.Tensor, sampled: torch.Tensor,
                processed: torch.Tensor | None) -> None:
        if processed is None:  # all greedy: vLLM's logprobs are those of the raw logits
            processed = logits.log_softmax(dim=-1, dtype=torch.float32)
        rows = sampled.shape[0]
        lp = processed.gather(-1, sampled.long().unsqueeze(-1)).squeeze(-1)
        req_ids = list(self.runner.input_batch.req_ids[:rows])
        discard = self.runner.discard_request_mask.np[:rows].copy()
        self.steps.append((req_ids, discard, lp))

    def start(self) -> None:
        self.steps = []
        self.active = True

    def collect(self) -> dict[tuple[str, int], list[float]]:
        """Stop recording; the logprobs of every sampled token since `start`, by (request id
        given to vLLM, child index), in sampling order."""
        self.active = False
        steps, self.steps = self.steps, []
        out: dict[str, list[float]] = {}
        for req_ids, discard, lp in steps:
            for rid, skip, value in zip(req_ids, discard.tolist(), lp.tolist()):
                if not skip:
                    out.setdefault(rid, []).append(value)
        return {parse_request_id(rid): values for rid, values in out.items()}


def parse_request_id(rid: str) -> tuple[str, int]:
    """vLLM's internal id of a request -> (the id llamarl gave it, child index; 0 for n = 1)."""
    head, dash, suffix = rid.rpartition("-")
    if not dash or len(suffix) != 8:
        raise RuntimeError(f"vLLM's request id {rid!r} is not '<id>-<8 chars>': this vLLM "
                           "names requests differently; the sampled logprobs cannot be matched")
    index, underscore, given = head.partition("_")
    if underscore and index.isdigit():
        return given, int(index)
    return head, 0
