"""The held-out evaluation of a generator's current weights, through its rollout source."""

from __future__ import annotations

import json
import time

from llamarl.generator.engine import sampler_seed
from llamarl.launch.runtime import Runtime, log
from llamarl.rollout.source import RolloutSource
from llamarl.timeline import Timeline


class Evaluator:
    """Held-out reward: sampled at the training temperature (the quantity RL maximises) and
    greedy. Each engine scores its shard; engine 0 aggregates and appends to eval.jsonl.
    The reward is the training reward without shaping (no overlong penalty) and, with
    reward.model_placement = trainer, without the reward model (it is not loaded here)."""

    def __init__(self, rt: Runtime, source: RolloutSource, prompts):
        self.rt, self.source, self.prompts = rt, source, prompts
        self.timeline: Timeline | None = None

    def run(self, step: int, version: int) -> None:
        rt, g = self.rt, self.rt.cfg.generator
        t0 = time.perf_counter()
        n = rt.cfg.data.eval_samples_per_prompt
        start = time.time()
        e, seed = rt.role.index, rt.cfg.run.seed
        # continuous mode: the running samples wait (paused) and continue after
        paused = self.source.ctx.engine.pause()
        try:
            sampled = self.source.collect(self.prompts, n, g.temperature,
                                          sampler_seed(seed, "eval", step, e), version)
            greedy = self.source.collect(self.prompts, 1, 0.0,
                                         sampler_seed(seed, "greedy", step, e), version)
        finally:
            if paused:
                self.source.ctx.engine.resume()
        if self.timeline is not None:
            self.timeline.record("eval", start, time.time(), step)
        s = sum(r for grp in sampled.groups for r in grp.rewards)
        gr = sum(r for grp in greedy.groups for r in grp.rewards)
        if not rt.role.is_engine_leader:
            return
        calls = sampled.metrics.get("tool_calls", 0.0)  # multi-turn: sampled episodes' calls
        rt.store.set(f"eval/{step}/{rt.role.index}",
                     json.dumps([s, len(self.prompts) * n, gr, len(self.prompts), calls]))
        if rt.role.index != 0:
            return
        parts = [json.loads(rt.wait_key(f"eval/{step}/{k}")) for k in range(rt.layout.engines)]
        row = {"step": step, "policy_version": version,
               "reward_mean": sum(p[0] for p in parts) / sum(p[1] for p in parts),
               "reward_mean_greedy": sum(p[2] for p in parts) / sum(p[3] for p in parts),
               "prompts": sum(p[3] for p in parts), "samples_per_prompt": n,
               "eval_s": time.perf_counter() - t0}
        if rt.cfg.rollout.source == "multi_turn":
            row["tool_calls_per_episode"] = (sum(p[4] for p in parts)
                                             / max(sum(p[1] for p in parts), 1))
        with open(rt.run_dir / "eval.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        rt.store.set(f"eval/result/{step}", json.dumps(row))
        calls = (f", {row['tool_calls_per_episode']:.2f} tool calls per episode"
                 if "tool_calls_per_episode" in row else "")
        log(rt, f"eval step {step}: held-out reward {row['reward_mean']:.3f} "
                f"(greedy {row['reward_mean_greedy']:.3f}) on {row['prompts']} prompts{calls}")
