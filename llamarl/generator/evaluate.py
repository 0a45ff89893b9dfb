"""The held-out evaluation of a generator's current weights, through its rollout source."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from llamarl.generator.engine import sampler_seed
from llamarl.generator.samples import append_rows, sample_rows
from llamarl.rollout.source import RolloutSource
from llamarl.runtime.roster import Roster
from llamarl.runtime.setup import Runtime, log
from llamarl.timeline import Timeline


class Evaluator:
    """Held-out reward: sampled at the training temperature (the quantity RL maximises) and
    greedy. Each engine scores the held-out shard of each slot it makes (runtime/roster.py:
    its own, and a lost engine's that it took over); the first live engine aggregates and
    appends to eval.jsonl. The reward is the training reward without shaping (no overlong
    penalty) and, with reward.model_placement = trainer, without the reward model (it is not
    loaded here). Every held-out sample goes to RUN_DIR/samples/eval_<step>.jsonl
    (generator/samples.py)."""

    def __init__(self, rt: Runtime, source: RolloutSource,
                 held_out: Callable[[], dict[int, list]]):
        self.rt, self.source, self.held_out = rt, source, held_out
        self.roster = Roster(rt.store, rt.layout.engines)
        self.timeline: Timeline | None = None

    def run(self, step: int, version: int) -> None:
        rt, g = self.rt, self.rt.cfg.generator
        t0 = time.perf_counter()
        n = rt.cfg.data.eval_samples_per_prompt
        start = time.time()
        seed = rt.cfg.run.seed
        results = {}
        # continuous mode: the running samples wait (paused) and continue after
        paused = self.source.ctx.engine.pause()
        try:
            for slot, prompts in self.held_out().items():
                sampled = self.source.collect(prompts, n, g.temperature,
                                              sampler_seed(seed, "eval", step, slot), version)
                greedy = self.source.collect(prompts, 1, 0.0,
                                             sampler_seed(seed, "greedy", step, slot), version)
                s = sum(r for grp in sampled.groups for r in grp.rewards)
                gr = sum(r for grp in greedy.groups for r in grp.rewards)
                tok = self.source.ctx.tokenizer
                rows = (sample_rows(sampled.groups, tok, step, "sampled")
                        + sample_rows(greedy.groups, tok, step, "greedy"))
                rt.store.set(f"eval/{step}/{slot}/samples", json.dumps(rows))
                # the sampled counts, for the source's own eval metrics (eval_metrics)
                results[slot] = [s, len(prompts) * n, gr, len(prompts), sampled.metrics]
        finally:
            if paused:
                self.source.ctx.engine.resume()
        if self.timeline is not None:
            self.timeline.record("eval", start, time.time(), step)
        for slot, part in results.items():
            rt.store.set(f"eval/{step}/{slot}", json.dumps(part))
        rt.store.set(f"eval/last/{rt.role.index}", str(step))
        if rt.role.index != min(self.roster.read().live):
            return
        parts, missing = self._gather(step)
        row = {"step": step, "policy_version": version,
               "reward_mean": sum(p[0] for p in parts) / sum(p[1] for p in parts),
               "reward_mean_greedy": sum(p[2] for p in parts) / sum(p[3] for p in parts),
               "prompts": sum(p[3] for p in parts), "samples_per_prompt": n,
               "eval_s": time.perf_counter() - t0}
        if missing:  # slots of an engine lost before it evaluated them
            row["slots_missing"] = missing
        # the source's own (multi_turn: tool calls per episode)
        row.update(type(self.source).eval_metrics([p[4] for p in parts],
                                                  sum(p[1] for p in parts)))
        with open(rt.run_dir / "eval.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        for slot in range(rt.layout.engines):  # (generator/samples.py)
            if slot not in missing:
                key = f"eval/{step}/{slot}/samples"
                append_rows(rt.run_dir / "samples" / f"eval_{step}.jsonl",
                            json.loads(rt.store.get(key)))
                rt.store.delete_key(key)
        rt.store.set(f"eval/result/{step}", json.dumps(row))
        calls = (f", {row['tool_calls_per_episode']:.2f} tool calls per episode"
                 if "tool_calls_per_episode" in row else "")
        log(rt, f"eval step {step}: held-out reward {row['reward_mean']:.3f} "
                f"(greedy {row['reward_mean_greedy']:.3f}) on {row['prompts']} prompts{calls}")

    def _gather(self, step: int) -> tuple[list[list], list[int]]:
        """Every slot's scores of evaluation `step`, and the slots that will not have any: an
        engine was lost before it evaluated them, and the engine that took them over had
        evaluated `step` already (it says so in `eval/last/<engine>`)."""
        store, me = self.rt.store, self.rt.role.index
        parts, missing = [], []
        for slot in range(self.rt.layout.engines):
            key = f"eval/{step}/{slot}"
            while not store.check([key]):
                owner = self.roster.read().owner[slot]
                last = f"eval/last/{owner}"
                if owner == me or (store.check([last]) and int(store.get(last)) >= step
                                   and not store.check([key])):
                    missing.append(slot)
                    break
                self.rt.watchdog.check()
                time.sleep(0.05)
            else:
                parts.append(json.loads(store.get(key)))
        return parts, missing
