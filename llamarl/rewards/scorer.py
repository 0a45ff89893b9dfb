"""The reward of a batch of completions: weighted reward functions, a reward model, shaping.

For completion i of a batch (B samples):

    reward_i = sum_k w_k * f_k(completion_i, answer_i, prompt_i)      reward.functions / weights
             + w_rm * RM(prompt_i + completion_i)                     reward.model_path / weight
             + R_length(len_i)                                        reward.overlong_* (training)

Built-in verifiers run in this process; user functions (`module:function`) run in a worker
process, the whole batch in one message (llamarl/rewards/sandbox.py); the reward model scores
the batch in sub-batches (llamarl/rewards/reward_model.py); with reward.model_placement =
trainer this scorer leaves the reward model out and the trainer ranks add its term
(llamarl/trainer/reward_model.py). A function call that raises, returns a non-number or times
out (reward.timeout_s) is handled as reward.on_error says:
  * stop: RuntimeError naming the function and the sample; the run stops with it.
  * zero: that component is 0 for that sample; the run goes on; counted in metrics.jsonl as
    `reward_errors` / `reward_timeouts`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamarl.config import RewardConfig
from llamarl.rewards.registry import is_user_function, resolve_builtin
from llamarl.rewards.shaping import overlong_penalty

REWARD_MODEL = "reward_model"  # component name of the reward model's score
OVERLONG = "overlong"  # component name of the length penalty
_SHOWN_CHARS = 200  # of a prompt or completion in an error message


@dataclass
class Scores:
    totals: list[float]  # [B] reward of each sample
    components: dict[str, list[float]] = field(default_factory=dict)  # name -> [B], unweighted
    errors: int = 0  # function calls that raised or returned a non-number (on_error = zero)
    timeouts: int = 0  # function calls that ran past reward.timeout_s (on_error = zero)


@dataclass
class ScoredGroup:
    """One prompt's G completions and their rewards."""

    prompt: object  # the prompt (token_ids, text, answer)
    completions: list  # G engine completions
    rewards: list[float]  # [G] total reward of each completion
    components: dict[str, list[float]] = field(default_factory=dict)  # name -> [G] unweighted
    index: int = 0  # position among every prompt drawn for this batch (unique within it)
    samples: list = field(default_factory=list)  # [G] buffer.record.Sample, the trained record
    # rollout counts summed over the G episodes (rollout.source = agent: model calls, prefix
    # breaks, agent_<metric>), for a batch's metrics over its own groups
    counts: dict[str, float] = field(default_factory=dict)


def group_counts(groups: list[ScoredGroup]) -> dict[str, float]:
    """The groups' `counts` summed, key by key (the keys any group has)."""
    total: dict[str, float] = {}
    for grp in groups:
        for k, v in grp.counts.items():
            total[k] = total.get(k, 0.0) + v
    return total


class RewardScorer:
    def __init__(self, cfg: RewardConfig, max_new_tokens: int, device: str = "cpu"):
        self.cfg = cfg
        self.max_new_tokens = max_new_tokens
        self.names = list(cfg.functions)
        self.weights = list(cfg.weights) if cfg.weights else [1.0] * len(self.names)
        self.builtins = {n: resolve_builtin(n, cfg.format_pattern)
                         for n in self.names if not is_user_function(n)}
        self.user_names = [n for n in self.names if is_user_function(n)]
        self.worker = None
        if self.user_names:
            from llamarl.rewards.sandbox import UserFunctionWorker
            self.worker = UserFunctionWorker(self.user_names, cfg.timeout_s)
        self.model = None
        if cfg.model_path and cfg.model_placement == "generator":  # else: trainer/reward_model.py
            from llamarl.rewards.reward_model import SequenceRewardModel
            self.model = SequenceRewardModel(cfg.model_path, device, cfg.model_batch_size)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def score(self, prompts: list[str], completions: list[str], answers: list[str],
              lengths: list[int] | None = None) -> Scores:
        """Rewards of B samples. `lengths` (tokens per completion) turns on the overlong
        penalty for training batches; evaluation leaves it out."""
        samples = list(zip(completions, answers, prompts))
        out = Scores(totals=[0.0] * len(samples))
        user = self.worker.score(samples) if self.worker is not None else []
        for name, w in zip(self.names, self.weights):
            if name in self.builtins:
                outcomes = [_call_builtin(self.builtins[name], s) for s in samples]
            else:
                outcomes = user[self.user_names.index(name)]
            values = [self._value(name, o, s, out) for o, s in zip(outcomes, samples)]
            self._add(out, name, w, values)
        if self.model is not None:
            texts = [p + c for p, c in zip(prompts, completions)]
            self._add(out, REWARD_MODEL, self.cfg.model_weight, self.model.score(texts))
        if lengths is not None and self.cfg.overlong_buffer > 0:
            pen = [overlong_penalty(n, self.max_new_tokens, self.cfg.overlong_buffer,
                                    self.cfg.overlong_penalty) for n in lengths]
            self._add(out, OVERLONG, 1.0, pen)
        return out

    @staticmethod
    def _add(out: Scores, name: str, weight: float, values: list[float]) -> None:
        out.components[name] = values
        for i, v in enumerate(values):
            out.totals[i] += weight * v

    def _value(self, name: str, outcome, sample: tuple[str, str, str], out: Scores) -> float:
        kind, value = outcome
        if kind == "ok":
            return value
        if self.cfg.on_error == "stop":
            completion, _, prompt = sample
            what = (f"timed out after {self.cfg.timeout_s:g} s (reward.timeout_s)"
                    if kind == "timeout" else value)
            raise RuntimeError(f"reward function {name!r} {what} (prompt "
                               f"{prompt[:_SHOWN_CHARS]!r}, completion "
                               f"{completion[:_SHOWN_CHARS]!r}); set reward.on_error=zero to "
                               "score such samples 0 and go on")
        if kind == "timeout":
            out.timeouts += 1
        else:
            out.errors += 1
        return 0.0


def score_groups(scorer: RewardScorer, prompts, groups, first: int = 0,
                 shaped: bool = True) -> tuple[list[ScoredGroup], Scores]:
    """Score every completion of every group in one scorer call (one message to the user
    function worker, sub-batches for the reward model). `prompts[j]` has .text and .answer,
    `groups[j]` is a list of completions with .text and .token_ids; group j gets index
    first + j. `shaped` adds the overlong penalty (training, not evaluation)."""
    flat = [(p, c) for p, grp in zip(prompts, groups) for c in grp]
    scores = scorer.score([p.text for p, _ in flat], [c.text for _, c in flat],
                          [p.answer for p, _ in flat],
                          [len(c.token_ids) for _, c in flat] if shaped else None)
    out, at = [], 0
    for j, (prompt, group) in enumerate(zip(prompts, groups)):
        end = at + len(group)
        out.append(ScoredGroup(prompt, group, scores.totals[at:end],
                               {k: v[at:end] for k, v in scores.components.items()}, first + j))
        at = end
    return out, scores


def _call_builtin(fn, sample: tuple[str, str, str]):
    try:
        return ("ok", float(fn(*sample)))
    except Exception as e:  # a verifier may reject a malformed reference answer
        return ("error", f"raised {type(e).__name__}: {e}")


def reward_metrics(infos: list[dict]) -> dict:
    """Reward and dynamic-sampling counts of one trainer step, from the rollout batches' info
    (one per engine): counts are summed, rounds are the maximum, component means averaged."""
    row = {key: sum(int(i.get(key, 0)) for i in infos)
           for key in ("reward_errors", "reward_timeouts", "ds_dropped_groups",
                       "ds_filled_groups")}
    row["ds_rounds"] = max((int(i.get("ds_rounds", 1)) for i in infos), default=1)
    means: dict[str, list[float]] = {}
    for info in infos:
        for name, value in info.get("reward_components", {}).items():
            means.setdefault(name, []).append(value)
    for name, values in means.items():
        row[f"reward/{name}"] = sum(values) / len(values)
    return row

