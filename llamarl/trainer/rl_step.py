"""One RL update on this trainer rank's share of a rollout batch.

    1. advantages
       outcome estimators (grpo, dr_grpo, rloo, reinforce_pp*): A_i per sequence
           (algorithms/advantages.py), the same for every token of sample i;
           with a KL reward penalty (algorithm.kl_mode = reward):
               A_it = A_i - beta * sum_{s>=t} KL_s
       ppo: per-token rewards (outcome at the last token, -beta * KL_t on every token), the
           critic's values V_old, GAE -> A_t and returns R_t, A whitened over the global batch
           (algorithms/gae.py)
       on_policy_distill: A_t = -distill_coef * (log pi_theta - log pi_teacher)_t
           + reward_coef * A_i, per sampled token (algorithms/distill.py)
       (the whole local batch is padded once; the reference's and the teacher's logprobs, the
       policy's own before the update (the student's, for distillation) and the critic's
       values come from one no-grad pass over it and are attached to the padded batch)
    2. for each of algorithm.epochs passes, cut the batch into algorithm.mini_batches parts;
       for each part one optimizer step of the policy (policy_loss, + beta * KL in loss mode,
       - entropy bonus) and, for PPO, one of the critic (clipped value loss)

Micro-batches are trainer.micro_batch_size padded rows each, or, with
trainer.max_tokens_per_micro_batch, bins of whole sequences packed end to end (first-fit
decreasing by length), the model running on the packed row without padding; either way the
losses read the same [B, T-1] tensors and the gradient sums the same per-token terms.

FSDP2 makes every forward a collective, so every trainer rank runs the same number of
micro-batches in every phase; a rank with fewer sequences (stale samples dropped, an uneven
mini-batch cut) runs masked filler micro-batches that contribute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from llamarl.algorithms.advantages import compute_advantages, equal_reward_groups
from llamarl.algorithms.distill import distill_advantages
from llamarl.algorithms.gae import gae, masked_whiten, reward_to_go, token_rewards, value_loss
from llamarl.algorithms.kl import kl_estimate
from llamarl.algorithms.policy_loss import aggregate, policy_loss
from llamarl.buffer.record import RolloutBatch
from llamarl.registry.algorithms import advantage_name, algorithm
from llamarl.trainer import critic as critic_mod
from llamarl.trainer.policy import TokenBatch, pad_rollouts, token_logprobs
from llamarl.trainer.step import PolicyTrainer


def policy_step(trainer: PolicyTrainer, batch: RolloutBatch | None, cfg, pad_id: int,
                version: int = 0, filler: RolloutBatch | None = None,
                reference: torch.nn.Module | None = None,
                critic: PolicyTrainer | None = None,
                teacher: torch.nn.Module | None = None) -> dict:
    """The whole update for one rollout batch (see the module docstring). `filler` holds the
    samples dropped as stale (counted, and used only as masked filler); `teacher`: the
    frozen teacher of on_policy_distill. Returns stats summed over the trainer ranks."""
    alg, mb = cfg.algorithm, MicroBatching.of(cfg, trainer.model)
    n = len(batch) if batch is not None else 0
    totals = _global_counts(batch, n, version, filler)
    # The padded tensors of the whole local batch, once: micro-batches are row slices of it.
    full = pad_rollouts(batch, pad_id) if n else None
    blank = _filler(batch if n else filler, pad_id)

    # 1. advantages (and for PPO returns and old values) as fields of the padded batch
    rewards = batch.rewards.float() if n else torch.zeros(0)
    kl_reward = reference is not None and alg.kl_mode == "reward"
    kl_sum, kl_teacher_sum = torch.zeros(()), torch.zeros(())
    assert (teacher is not None) == algorithm(alg).teacher, "a teacher iff distilling"
    gae_advantages = algorithm(alg).critic  # PPO: per-token advantages from the critic
    if not gae_advantages:
        gids = batch.group_ids if n else torch.zeros(0, dtype=torch.long)
        lengths = batch.sampled_tokens() if n else torch.zeros(0)
        adv_seq = compute_advantages(advantage_name(alg), rewards, gids, lengths, alg.adv_eps,
                                     _all_reduce_sum)
        if full is not None:
            full.advantages = adv_seq
    frozen = {name: m for name, m in (
        ("ref", reference), ("teacher", teacher),
        ("student", trainer.model if teacher is not None else None)) if m is not None}
    if frozen or critic is not None:
        # no-grad forwards over the whole local batch once, [n, T-1]: the reference's logprobs
        # (read by a KL loss on every pass, or turned into a KL reward), the teacher's and the
        # student's (distillation's advantages) and the critic's values
        logps, v = no_grad_passes(full, blank, mb, frozen, trainer.device, trainer.temperature,
                                  critic)
        ref_logp = logps.get("ref")
        if full is not None:
            full.ref_logp = ref_logp
    if teacher is not None:
        m = full.mask if full is not None else torch.zeros(0, 1)
        adv_tok, reverse_kl = distill_advantages(logps["student"], logps["teacher"], m,
                                                 adv_seq, alg.distill_coef, alg.reward_coef)
        kl_teacher_sum = reverse_kl.sum()
        if full is not None:
            full.advantages = adv_tok
    if gae_advantages or kl_reward:
        # GAE's backward recursion is one loop over T for all sequences
        m = full.mask if full is not None else torch.zeros(0, 1)
        kl = None
        if kl_reward:
            # behaviour logprobs stand in for the current policy's (on-policy: equal up to the
            # engine/trainer mismatch), which saves one policy forward
            old = full.old_logp if full is not None else torch.zeros(0, 1)
            kl = kl_estimate(old, ref_logp, alg.kl_estimator)
        if kl is not None:
            kl_sum = (kl * m).sum()
        if gae_advantages:
            adv, ret = gae(token_rewards(rewards, m, kl, alg.kl_coef), v, m, alg.gamma, alg.lam)
            if alg.whiten_advantages:  # over the completion tokens of every trainer rank
                keep = m > 0
                adv = torch.zeros_like(adv).index_put_(
                    (keep,), masked_whiten(adv[keep], torch.ones_like(adv[keep]), 1e-8,
                                           _all_reduce_sum))
            if full is not None:
                full.advantages, full.returns, full.old_values = adv, ret, v
        elif full is not None:  # (distillation's advantages are already per token)
            base = full.advantages if teacher is not None else adv_seq[:, None]
            full.advantages = base - alg.kl_coef * reward_to_go(kl, m)

    # 2. epochs x mini-batches of optimizer steps
    step_stats, critic_stats = [], []
    # [real, computed] tokens of the policy's forwards, [shared, all] of its micro-batches
    forward_tokens = torch.zeros(4)
    rank = dist.get_rank() if dist.is_initialized() else 0
    E, M = alg.epochs, alg.mini_batches
    for epoch in range(E):
        order = torch.arange(n)
        if E > 1 or M > 1:  # a fresh cut every pass, reproducible from (seed, version, pass)
            g = torch.Generator().manual_seed(((cfg.run.seed * 1_000_003 + version) * 101 + epoch)
                                                  * 4099 + rank)
            order = torch.randperm(n, generator=g)
        for part in range(M):
            idx = order[part * n // M:(part + 1) * n // M]
            micro, norm, tok_norm = _mini_batch(full, idx, blank, mb, cfg)
            forward_tokens += _forward_tokens(micro, blank)
            step_stats.append(trainer.step(micro, _policy_loss_fn(alg, norm, reference)))
            if critic is not None:
                critic_stats.append(critic.step(micro, _value_loss_fn(cfg, tok_norm)))
    stats = _combine(step_stats, E)
    if critic is not None:
        c = _combine(critic_stats, E)
        stats.update(value_loss=c["loss"], critic_grad_norm=c["grad_norm"],
                     value_clipped=c["value_clipped"], value_sum=c["value_sum"],
                     value_err_sum=c["value_err_sum"])
    if kl_reward:
        stats["kl_ref"] = float(_all_reduce_sum(kl_sum))
    if teacher is not None:  # the sum of d_t over the sampled tokens of every rank
        stats["kl_teacher"] = float(_all_reduce_sum(kl_teacher_sum))
    real, computed, shared, micro = _all_reduce_sum(forward_tokens).tolist()
    stats["padding_share"] = 1.0 - real / max(computed, 1.0)
    stats["shared_prompts"] = shared / max(micro, 1.0)
    stats.update(totals)
    return stats


def _global_counts(batch, n: int, version: int, filler) -> dict:
    """Token, sequence, reward and staleness totals over every trainer rank."""
    stale = (version - batch.policy_version) if n else torch.zeros(1)
    equal = equal_reward_groups(batch.rewards, batch.group_ids) if n else torch.zeros(0)
    local = torch.tensor([float(batch.loss_mask.sum()) if n else 0.0, float(n),
                          float(batch.rewards.sum()) if n else 0.0,
                          float(batch.finished.sum()) if n else 0.0,
                          float(stale.sum()) if n else 0.0,
                          float(len(filler)) if filler is not None else 0.0,
                          float(batch.seq_lens.sum()) if n else 0.0, float(equal.sum())])
    top = torch.tensor([float(stale.max()) if n else 0.0])
    if dist.is_initialized():
        dist.all_reduce(local)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
    keys = ("n_tokens", "n_seqs", "reward_sum", "finished", "staleness_sum", "dropped",
            "n_tokens_all", "equal_reward_seqs")
    return dict(zip(keys, local.tolist()), staleness_max=float(top))


@dataclass
class MicroBatching:
    """How a mini-batch is cut into micro-batches (trainer.*): `rows` padded rows each, or
    packed bins of `max_tokens` tokens (> 0); `share` prompts (auto | true | false) with,
    for auto, the cost of a forward per layer: `per_token` for each token computed (the
    multiply-adds of its matrix products, ~ 4h^2 + 3hi for hidden h and MLP width i) and
    `per_pair` for each (query, key) pair the attention computes: its 2h multiply-adds
    (scores, weighted values) weighted 3x, as a masked attention kernel runs well below the
    matrix products' rate (on the CPU the 24M model with 64-128-token answers measured a tie
    between the layouts, bench/micro_batch_order.py --workload gen24m, where an unweighted
    2h made the shared one 13% cheaper; 3x leans to padded rows when in doubt)."""

    rows: int
    max_tokens: int = 0
    share: str = "false"
    per_token: float = 0.0
    per_pair: float = 0.0

    @classmethod
    def of(cls, cfg, model: torch.nn.Module | None = None) -> MicroBatching:
        share = cfg.trainer.share_prompts
        if share == "auto" and (cfg.trainer.max_tokens_per_micro_batch > 0
                                or cfg.model.attn_implementation != "sdpa"):
            share = "false"  # it needs padded micro-batches and a 4-D mask
        mc = getattr(model, "config", None)
        h = getattr(mc, "hidden_size", 0) or 0
        i = getattr(mc, "intermediate_size", 0) or 4 * h
        return cls(cfg.trainer.micro_batch_size, cfg.trainer.max_tokens_per_micro_batch,
                   share, 4.0 * h * h + 3.0 * h * i, 3 * 2.0 * h)

    def shared_is_cheaper(self, lens: torch.Tensor, prompt_lens: torch.Tensor,
                          group_ids: torch.Tensor, grouped: torch.Tensor) -> bool:
        """For share = auto: whether the shared-prompt micro-batches of these rows cost less
        than the padded ones, by the FLOPs each computes: B x T tokens and B x T^2 attention
        pairs for a micro-batch of B rows padded to T; N x L and N x L^2 for N trees padded
        to L (the dense mask computes the whole square either way). `grouped`: the rows'
        indices in `by_group`'s order."""
        def cost(widths: list[int], counts: list[int]) -> float:
            return sum(c * w * (self.per_token + w * self.per_pair)
                       for w, c in zip(widths, counts))

        padded = [p.max() for p in torch.sort(lens, descending=True).values.split(self.rows)]
        trees = []
        for part in grouped.split(self.rows):
            _, t_len = tree_lengths(lens[part], prompt_lens[part], group_ids[part])
            trees.append((int(t_len.max()), len(t_len)))
        sizes = [len(x) for x in lens.split(self.rows)]
        return cost([w for w, _ in trees], [n for _, n in trees]) < cost(
            [int(w) for w in padded], sizes)


def _cut(full: TokenBatch | None, idx: torch.Tensor, blank: TokenBatch,
         mb: MicroBatching) -> list[tuple[torch.Tensor, TokenBatch]]:
    """The micro-batches of rows `idx` of the padded batch, as (rows, micro-batch): `mb.rows`
    rows each, rows of similar lengths together (`by_length`), or with shared prompts whole
    groups together (`by_group`), each group's prompt computed once; or with a token budget
    `mb.max_tokens` > 0 packed bins of whole sequences; then masked filler up to the largest
    count of any trainer rank (every rank runs as many forwards)."""
    lens = full.attention_mask[idx].sum(1) if full is not None else None
    share = False
    if full is None or not len(idx):
        parts = []
    elif mb.max_tokens > 0:
        parts = [idx[torch.tensor(b)] for b in pack_bins(lens.tolist(), mb.max_tokens)]
    else:
        p, g = full.prompt_lens[idx], full.group_ids[idx]
        grouped = by_group(torch.arange(len(idx)), lens, p, g) if mb.share != "false" else None
        share = mb.share == "true" or (mb.share == "auto"
                                       and mb.shared_is_cheaper(lens, p, g, grouped))
        parts = list((idx[grouped] if share else by_length(idx, lens)).split(mb.rows))
    cut = [(rows, full.take(rows).pack() if mb.max_tokens > 0
            else full.take(rows).share() if share else full.take(rows)) for rows in parts]
    count = torch.tensor([float(len(cut))])
    if dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return cut + [(idx[:0], blank)] * (int(count) - len(cut))


def by_length(idx: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """`idx` [n] ordered by `lens` [n] (each row's tokens), longest first, ties in the given
    order: cut into micro-batches of a fixed row count, rows of similar lengths share one and
    each is padded to nearly its own rows' length. In the order given (a batch's groups, one
    prompt each), a micro-batch is padded to the longest of rows of any length: on the
    default recipe's batches a quarter to a third of the tokens computed were padding
    (6% in this order; bench/micro_batch_order.py). The update is the same sum of
    per-token terms over the same rows, in another order (float rounding aside)."""
    return idx[torch.sort(lens, descending=True, stable=True).indices]


def by_group(idx: torch.Tensor, lens: torch.Tensor, prompt_lens: torch.Tensor,
             group_ids: torch.Tensor) -> torch.Tensor:
    """`idx` [n] with the rows of each group together, in the given order within a group,
    groups ordered by their shared-prompt length (the prompt once plus every row's tokens
    after it: trainer/shared_prompts.py), longest first: cut into micro-batches of a fixed
    row count, a group of at most that many rows is one tree of one micro-batch, and each
    micro-batch is padded to nearly its own trees' length."""
    group, tree_len = tree_lengths(lens, prompt_lens, group_ids)
    by_id = torch.sort(group, stable=True).indices
    order = by_id[torch.sort(tree_len[group[by_id]], descending=True, stable=True).indices]
    return idx[order]


def tree_lengths(lens: torch.Tensor, prompt_lens: torch.Tensor,
                 group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] each row's group (0..G-1, by group id) and [G] each group's shared-prompt length:
    its prompt once plus every row's tokens after it."""
    p = torch.minimum(prompt_lens.long(), lens.long())
    _, group = torch.unique(group_ids, return_inverse=True)
    zero = torch.zeros(int(group.max()) + 1 if len(group) else 0, dtype=torch.long)
    return group, (zero.index_add(0, group, lens.long() - p)
                   + zero.scatter_reduce(0, group, p, "amax", include_self=False))


def pack_bins(lens: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: indices into `lens` grouped so that each group's lengths sum to
    at most `budget` (a longer sequence alone); deterministic, groups in ascending index."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])  # stable: ties by index
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for k, r in enumerate(room):
            if lens[i] <= r:
                bins[k].append(i)
                room[k] -= lens[i]
                break
        else:
            bins.append([i])
            room.append(budget - lens[i])
    return [sorted(b) for b in bins]


def no_grad_passes(full: TokenBatch | None, blank: TokenBatch, mb: MicroBatching,
                   models: dict[str, torch.nn.Module], device: torch.device,
                   temperature: float, critic: PolicyTrainer | None = None):
    """No-grad forwards over the local batch in the update's micro-batches (padded, packed or
    shared-prompt, with masked filler: collectives under FSDP2), gathered into [n, T-1] on
    the CPU: {name: logprobs at the sampling temperature} of each model of `models` (the
    reference, the teacher, the policy itself: in this order on every rank), and the
    critic's values (or None). 0 where no token is scored."""
    n = full.input_ids.shape[0] if full is not None else 0
    shape = full.mask.shape if full is not None else (0, 1)
    logps = {name: torch.zeros(shape) for name in models}
    v_all = torch.zeros(shape) if critic is not None else None
    with torch.no_grad():
        for rows, micro in _cut(full, torch.arange(n), blank, mb):
            tbd = micro.to(device)
            width = tbd.mask.shape[1]
            for name, model in models.items():
                model.eval()  # (the policy's next step sets train() again)
                lp, _ = token_logprobs(model, tbd, temperature)
                if len(rows):
                    logps[name][rows, :width] = lp.cpu()
            if critic is not None:
                critic.model.eval()
                v = critic_mod.values(critic.model, tbd).cpu()
                if len(rows):
                    v_all[rows, :width] = v
    return logps, v_all


def _mini_batch(full: TokenBatch | None, idx: torch.Tensor, blank: TokenBatch,
                mb: MicroBatching, cfg):
    """Micro-batches of the rows `idx` of the padded batch (with masked filler up to the
    global micro-batch count); and the mini-batch's global loss normaliser
    (algorithm.loss_agg) and sampled-token count."""
    local = torch.tensor([float(full.mask[idx].sum()) if len(idx) else 0.0, float(len(idx))])
    if dist.is_initialized():
        dist.all_reduce(local)
    n_tokens, n_seqs = max(float(local[0]), 1.0), max(float(local[1]), 1.0)
    norm = {"token_mean": n_tokens, "seq_mean_token_mean": n_seqs,
            # Dr. GRPO: a constant, N_seqs x the longest allowed response
            "seq_sum_constant": n_seqs * cfg.generator.max_new_tokens}[cfg.algorithm.loss_agg]
    return [micro for _, micro in _cut(full, idx, blank, mb)], norm, n_tokens


def _forward_tokens(micro: list[TokenBatch], blank: TokenBatch) -> torch.Tensor:
    """[real, computed] tokens of the forwards of `micro` (padding, and a filler micro-batch,
    all of it, is computed but not real), [shared-prompt, all] micro-batches."""
    out = torch.zeros(4)
    for m in micro:
        real, computed = m.computed_tokens()
        out[1] += computed
        out[3] += 1
        if m is not blank:
            out[0] += real
            out[2] += m.shared is not None
    return out


def _policy_loss_fn(alg, norm: float, reference):
    def loss_fn(logp, mbatch: TokenBatch, entropy):
        adv = mbatch.advantages if mbatch.advantages is not None else torch.zeros_like(logp)
        loss, stats = policy_loss(logp, mbatch.old_logp, adv, mbatch.mask, alg, norm)
        if reference is not None and alg.kl_mode == "loss":  # L += beta * KL(pi || pi_ref)
            ref_logp = mbatch.ref_logp if mbatch.ref_logp is not None else logp.detach()
            kl = kl_estimate(logp, ref_logp, alg.kl_estimator)
            loss = loss + alg.kl_coef * aggregate(kl, mbatch.mask, alg.loss_agg, norm)
            stats["kl_ref"] = (kl.detach() * mbatch.mask).sum()
        if alg.entropy_coef > 0:  # L -= c * H: keeps the policy from collapsing early
            loss = loss - alg.entropy_coef * aggregate(entropy, mbatch.mask, alg.loss_agg, norm)
        return loss, stats
    return loss_fn


def _value_loss_fn(cfg, tok_norm: float):
    def loss_fn(v, mbatch: TokenBatch, _entropy):
        zeros = torch.zeros_like(v)
        v_old = mbatch.old_values if mbatch.old_values is not None else zeros
        ret = mbatch.returns if mbatch.returns is not None else zeros
        per_token, clipped = value_loss(v, v_old, ret, cfg.critic.value_clip)
        loss = aggregate(per_token, mbatch.mask, "token_mean", tok_norm)
        m = mbatch.mask
        with torch.no_grad():
            stats = {"value_clipped": (clipped.float() * m).sum(),
                     "value_sum": (v.detach() * m).sum(),
                     "value_err_sum": ((v.detach() - ret) ** 2 * m).sum()}
        return loss, stats
    return loss_fn


def _combine(steps: list[dict], passes: int) -> dict:
    """Stats of the E x M optimizer steps of one update: loss and grad norm averaged over the
    steps, max/min keys by max/min, token sums averaged over the passes."""
    out: dict = {}
    for k in steps[0]:
        vals = [s[k] for s in steps if k in s]
        if k in ("loss", "grad_norm"):
            out[k] = sum(vals) / len(vals)
        elif k in ("lr", "skipped_total"):
            out[k] = vals[-1]
        elif k.endswith("_max"):
            out[k] = max(vals)
        elif k.endswith("_min"):
            out[k] = min(vals)
        else:
            out[k] = sum(vals) / passes
    if any("skipped" in s for s in steps):
        out["skipped"] = 1.0
    return out


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the trainer ranks (global-batch statistics of an estimator)."""
    if dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t)
    return t


def _filler(source: RolloutBatch, pad_id: int) -> TokenBatch:
    """A masked filler micro-batch: the first sample of `source` with its loss mask zeroed,
    and nothing for the losses to read."""
    tb = pad_rollouts(source.slice(0, 1), pad_id)
    tb.mask.zero_()
    return tb
