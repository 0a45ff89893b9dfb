"""Single-turn sampling: n completions per prompt in one generate call, scored by reward.*."""

from __future__ import annotations

import contextlib
import time

from llamarl.buffer.record import Sample
from llamarl.rewards.scorer import score_groups
from llamarl.rollout.source import Collected, RolloutSource


def completion_sample(prompt_ids: list[int], c, version: int) -> Sample:
    """The record of one single-turn sample: the prompt, then the engine's completion `c`
    (one segment per version that sampled it; `version` when it does not say)."""
    s = Sample(finish="stop" if c.finish_reason == "stop" else "length")
    s.add_context(prompt_ids)
    s.add_completion(c, version)
    return s


class SingleTurnSource(RolloutSource):
    def collect(self, prompts, n, temperature, seed, version, step=None,
                first=0) -> Collected:
        ctx = self.ctx
        t0 = time.perf_counter()
        with self._phase("generate", step):
            groups = ctx.engine.generate([p.token_ids for p in prompts], n, temperature,
                                         ctx.cfg.generator.max_new_tokens, seed=seed)
        t1 = time.perf_counter()
        with self._phase("reward", step):
            scored, scores = score_groups(ctx.scorer, prompts, groups, first,
                                          shaped=step is not None)
        for grp in scored:
            grp.samples += [completion_sample(grp.prompt.token_ids, c, version)
                            for c in grp.completions]
        return Collected(scored, {"generate_s": t1 - t0, "reward_s": time.perf_counter() - t1,
                                  "reward_errors": scores.errors,
                                  "reward_timeouts": scores.timeouts})

    def _phase(self, name: str, step):
        tl = self.ctx.timeline
        return tl.phase(name, step) if tl is not None and step is not None \
            else contextlib.nullcontext()
