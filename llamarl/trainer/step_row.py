"""One trainer step's metrics row (metrics.jsonl, TensorBoard, the progress line), written by
trainer 0 from a typed record of the step.

The row is the update's and the batch's metrics (here), where the step's time went (the
loop's StepTimer), then what each feature declares next to itself:

    kl_teacher                          trainer/teacher.py       teacher_metrics
    value_loss, value_mean, ...         trainer/critic.py        critic_metrics
    reward/<fn>, reward_errors, ds_*    rewards/scorer.py        reward_metrics
    engine_*_share, in_flight_mean ...  rollout/continuous_metrics.py (generator.mode =
                                        continuous)
    turns_per_episode, tool_calls ...   the rollout source's row_metrics (rollout/source.py;
                                        multi_turn and agent: rollout/episode_metrics.py)
    reward/reward_model, reward_model_s trainer/reward_model.py  TrainerRewardModel.add_scores
    engines_live                        runtime/roster.py (runs that survive engine loss)
"""

from __future__ import annotations

import hashlib
import resource
from dataclasses import dataclass, field

from llamarl.parallel.plan import plan_for
from llamarl.rewards.scorer import reward_metrics
from llamarl.rollout.continuous_metrics import continuous_metrics
from llamarl.rollout.source import source_class
from llamarl.runtime.roster import Roster
from llamarl.runtime.setup import Runtime, log
from llamarl.trainer.metrics import MetricsLog, MismatchWatch
from llamarl.trainer.parts import TrainerParts
from llamarl.trainer.rollouts import Rollouts
from llamarl.trainer.step_timer import StepTimer


@dataclass
class StepRecord:
    """What one trainer step did, as its row reports it (trainer/loop.py builds it)."""

    step: int  # steps done, this one included (the row's "step")
    version: int  # the policy version the step made
    rollouts: Rollouts  # the batches it trained on
    stats: dict[str, float]  # the update's (trainer/rl_step.py), summed over the trainer ranks
    dropped_total: int  # stale samples dropped by the run so far
    # the trainer-side reward model's entries (TrainerRewardModel.add_scores); {} without one
    reward_model: dict[str, float] = field(default_factory=dict)


def resident_mib() -> float:
    """This process's resident memory now (VmRSS), MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class StepRows:
    """Trainer 0's metrics.jsonl: a row per step, its progress line every run.log_every steps,
    and the mismatch alarm (trainer/metrics.py)."""

    def __init__(self, rt: Runtime, parts: TrainerParts, sender):
        self.rt, self.parts, self.sender = rt, parts, sender
        self.log = MetricsLog(rt.run_dir / "metrics.jsonl", kl_ref=parts.reference is not None,
                              resumed_at=rt.resume.get("step"))
        self.mismatch = MismatchWatch(rt.cfg.sync.mismatch_warn)
        # the source's own entries (read from its class: no source is built on a trainer)
        self.source = source_class(rt.cfg.rollout.source)
        self.roster = (Roster(rt.store, rt.layout.engines)
                       if plan_for(rt).survives_engine_loss else None)
        self.empty_steps = 0  # steps in a row whose episodes sampled no token

    def write(self, rec: StepRecord, timer: StepTimer, last: bool) -> None:
        row = self.row(rec, timer)
        self.log.write(row)
        if rec.step % self.rt.cfg.run.log_every == 0 or last:
            log(self.rt, self.log.line(row, self.rt.cfg.run.steps))
        alarm = self.mismatch.check(row)
        if alarm is not None:
            log(self.rt, alarm)
        # (a sample with no sampled token has no version: it is dropped as stale)
        self._check_sampled(row, rec.stats["n_seqs"] + rec.stats["dropped"])

    def _check_sampled(self, row: dict, sequences: float) -> None:
        """A step whose `sequences` (its samples, stale ones included) sampled no token trained
        on nothing: say so, with the gateway's most common refusal; run.max_empty_steps of
        them in a row stop the run (ValueError: one line, every rank stops)."""
        if row["tokens_generated"] > 0 or sequences == 0:
            self.empty_steps = 0
            return
        self.empty_steps += 1
        why = ""
        if row.get("gateway_4xx"):
            why = (f"; the gateway refused {row['gateway_4xx']} requests, most of them "
                   f"{row['gateway_4xx_reason']} (the generator's log says why)")
        elif row.get("agent_errors") or row.get("env_errors"):
            why = (f"; {row.get('agent_errors', 0) + row.get('env_errors', 0)} episodes "
                   "failed")
        limit = self.rt.cfg.run.max_empty_steps
        if limit and self.empty_steps >= limit:
            raise ValueError(f"{self.empty_steps} steps in a row sampled no token{why}: the "
                             "run trains on nothing; fix that and launch again "
                             f"(run.max_empty_steps = {limit}; 0 never stops)")
        log(self.rt, f"warning: step {row['step']}: its episodes sampled no token, the step "
                     f"trained on nothing{why}")

    def row(self, rec: StepRecord, timer: StepTimer) -> dict:
        """The step's row (closes the timer's period: call it once per step)."""
        s, got, info = rec.stats, rec.rollouts, rec.rollouts.info
        n_seqs, n_tok = max(s["n_seqs"], 1.0), max(s["n_tokens"], 1.0)
        row = {
            "step": rec.step, "policy_version": rec.version,
            "reward_mean": s["reward_sum"] / n_seqs,
            # samples whose group's rewards are all equal: no signal under a group baseline
            "equal_reward_share": s["equal_reward_seqs"] / n_seqs,
            "loss": s["loss"], "grad_norm": s["grad_norm"], "lr": s["lr"],
            "clip_frac": s.get("corrected", 0.0) / n_tok,
            "mismatch_kl": s.get("mismatch_kl", 0.0) / n_tok,
            "entropy": s.get("entropy_sum", 0.0) / n_tok,
            "kl_ref": s.get("kl_ref", 0.0) / n_tok,
            "ratio_mean": s.get("ratio_sum", 0.0) / n_tok,
            "ratio_max": s.get("ratio_max", 0.0), "ratio_min": s.get("ratio_min", 0.0),
            "staleness_mean": s["staleness_sum"] / n_seqs,
            "staleness_max": s["staleness_max"],
            "dropped_stale": int(s["dropped"]), "dropped_stale_total": rec.dropped_total,
            "batch_digest": hashlib.sha1(got.batch.token_ids.numpy().tobytes()).hexdigest()[:12]
            if got.batch is not None else "",
            "behaviour_version_by_engine": {i["generator"]: i["behaviour_version"]
                                            for i in info},
            "response_len": s["n_tokens"] / n_seqs,
            "finished_frac": s["finished"] / n_seqs,
            "tokens_generated": int(s["n_tokens"]),
            "data_bad_rows": max(i["data_bad_rows"] for i in info),
            "data_epoch": max(i["data_epoch"] for i in info),
            "generate_s": max(i["generate_s"] for i in info),
            "reward_s": max(i["reward_s"] for i in info),
            **timer.parts,  # wait_s, transfer_s, train_s, sync_s, checkpoint_s
            "train_tokens_per_s": s["n_tokens_all"] / max(timer.parts["train_s"], 1e-9),
            # the share of the update's forward tokens that are padding (0 when packed)
            "padding_share": s["padding_share"],
            # the share of its micro-batches that ran with shared prompts (trainer.share_prompts)
            "shared_prompts": s["shared_prompts"],
            # buffer cost: this rank's reads + the producers' writes (of the previous batch)
            "buffer_s": got.transfer_s + sum(i.get("prev_put_s", 0.0) for i in info),
            "broadcast_s": self.sender.last_broadcast_s,
            # what this trainer rank sends per weight sync, and its peak resident memory so far
            # (Linux's ru_maxrss is in KiB)
            "sync_mib": self.sender.bytes_per_sync / 2**20,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_mib": resident_mib(),  # now: a leak shows as growth from step to step
            **timer.close_period(rec.reward_model.get("reward_model_s", 0.0)),
            **self.parts.model_metrics(s),  # the teacher's, the critic's
            **reward_metrics(info),  # reward errors/timeouts, dynamic sampling, components
            **continuous_metrics([i.get("rollout", {}) for i in info]),
            # the source's: multi-turn turns, tool calls, errors, env time; agent calls
            **self.source.row_metrics([i.get("rollout", {}) for i in info]),
            **rec.reward_model,  # reward/reward_model, reward_model_s (trainer placement)
        }
        if self.roster is not None:  # engines alive (runtime/roster.py): fewer after a loss
            row["engines_live"] = len(self.roster.read().live)
        row["skipped_steps_total"] = int(s["skipped_total"])
        if "skipped" in s:
            row["skipped_step"] = 1
        return row
