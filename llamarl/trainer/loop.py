"""The trainer role: FSDP2 policy on the trainer sub-mesh, GRPO steps, weight broadcast.

On-policy loop of trainer rank r (of T), with E engines:

    for step in 0..steps-1:
        batch = concat(channel[e -> r].get() for e in engines)      # whole groups, version = step
        A = compute_advantages(algorithm.name, batch.rewards, ...)   # GRPO, RLOO, ...
        PolicyTrainer.step(micro-batches, clipped surrogate)         # one optimizer step
        WeightSender.send(model)                 # all ranks gather, rank 0 sends
    save the final policy as a Hugging Face directory
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from llamarl.algorithms.advantages import compute_advantages
from llamarl.algorithms.kl import kl_estimate
from llamarl.algorithms.policy_loss import aggregate, policy_loss
from llamarl.buffer.channel import open_channel
from llamarl.buffer.record import RolloutBatch
from llamarl.launch.runtime import Runtime, log
from llamarl.parallel.fsdp import apply_fsdp
from llamarl.parallel.groups import make_group
from llamarl.parallel.weight_sync import WeightSender, metas_to_json
from llamarl.rewards.scorer import reward_metrics
from llamarl.timeline import Timeline
from llamarl.trainer import checkpoint
from llamarl.trainer.metrics import MetricsLog
from llamarl.trainer.policy import DTYPES, collate, load_policy, token_logprobs
from llamarl.trainer.step import PolicyTrainer


def init_trainer_group(rt: Runtime):
    """The trainer sub-mesh: a role-local default group (trainer ranks only) and its mesh."""
    import os

    threads = rt.cfg.trainer.threads or max(1, (os.cpu_count() or 1) // rt.env.local_world_size)
    if rt.on_cpu:
        torch.set_num_threads(threads)
    else:
        torch.cuda.set_device(rt.device)
    backend = "nccl" if rt.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore("trainer", rt.store),
                            rank=rt.role.index, world_size=rt.layout.trainer_ranks,
                            timeout=timedelta(seconds=rt.cfg.sync.timeout_s))
    return init_device_mesh(rt.device.type, (rt.layout.trainer_ranks,))


def load_reference(cfg, model_path: str, mesh, device: torch.device):
    """The frozen reference policy (the starting checkpoint), FSDP2-sharded on the trainer
    mesh like the policy; None when algorithm.kl_coef is 0 (nothing is loaded)."""
    if cfg.algorithm.kl_coef == 0:
        return None
    ref = load_policy(model_path, cfg.model.dtype).to(device)
    ref.requires_grad_(False)
    ref.eval()
    return apply_fsdp(ref, mesh, param_dtype=DTYPES[cfg.model.dtype])


def open_weight_sender(rt: Runtime, model: torch.nn.Module) -> WeightSender:
    """Trainer r's sender on wsync<r> = [trainer r (group rank 0), every generator rank]; its
    shard layout goes to the store for the generators (see generator.loop.join_weight_groups)."""
    r = rt.role.index
    sender = WeightSender(model, r, rt.cfg.sync.bucket_mb, None, rt.device, rt.store)
    rt.store.set(f"wsync/meta/{r}", metas_to_json(sender.metas))
    n_gen = len(rt.layout.generator_global_ranks)
    sender.group = make_group(rt.group_spec(f"wsync{r}", 0, 1 + n_gen))
    return sender


def check_tokenizer(tokenizer, model_path: str) -> None:
    """Start-up check: RL needs completions that can end and batches that can be padded."""
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {model_path} has no EOS token, so no completion "
                         "could ever finish: set eos_token in its tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out; any id works


def resolve_model_path(rt: Runtime, mesh) -> str:
    """The policy's HF directory; builds the embedded tiny model's warm start when needed."""
    spec = rt.cfg.model.path
    if spec.startswith("tiny:"):
        from llamarl.tiny.warmstart import run_warm_start, warm_start_dir

        path = warm_start_dir(spec.split(":", 1)[1])
        if not (path / "config.json").is_file():
            log(rt, f"building the tiny model's warm start (cached at {path})")
            run_warm_start(spec.split(":", 1)[1], path, mesh, rt.device,
                           log=lambda m: log(rt, m) if rt.role.index == 0 else None)
        return str(path)
    if not (Path(spec) / "config.json").is_file():
        raise ValueError(f"model.path {spec!r} is not a Hugging Face model directory (no "
                         "config.json): point it at a local checkpoint or use tiny:reverse")
    return spec


def run_trainer(rt: Runtime) -> None:
    cfg, r, T = rt.cfg, rt.role.index, rt.layout.trainer_ranks
    mesh = init_trainer_group(rt)
    model_path = resolve_model_path(rt, mesh)
    if r == 0:
        rt.store.set("model/path", model_path)
        (rt.run_dir / "model.json").write_text(json.dumps({"spec": cfg.model.path,
                                                            "path": model_path}))
    model = load_policy(model_path, cfg.model.dtype).to(rt.device)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    check_tokenizer(tokenizer, model_path)
    apply_fsdp(model, mesh, param_dtype=DTYPES[cfg.model.dtype])
    trainer = PolicyTrainer(model, cfg.trainer, cfg.run.steps, T, rt.device,
                            cfg.generator.temperature, cfg.algorithm.entropy_coef > 0)
    reference = load_reference(cfg, model_path, mesh, rt.device)

    sender = open_weight_sender(rt, model)
    channels = [open_channel(rt, e, r, "consumer") for e in range(rt.layout.engines)]
    log(rt, "rollout channels: " + ", ".join(f"{ch.channel} over {ch.transport}"
                                             for ch in channels))
    metrics = MetricsLog(rt.run_dir / "metrics.jsonl") if r == 0 else None
    log(rt, f"policy {model_path} sharded over {T} trainer rank(s); "
            f"sends {sender.bytes_per_sync / 2**20:.2f} MiB of shards per weight sync in "
            f"{len(sender.buckets)} bucket(s)")

    timeline = Timeline(rt.run_dir, rt.role.rank, rt.role.name)
    version, dropped_total, k = 0, 0, cfg.sync.max_staleness
    resume = rt.resume
    if resume:
        meta = checkpoint.load(Path(resume["checkpoint"]), model, trainer.opt, trainer.sched)
        version = meta["policy_version"]
        if version >= cfg.run.steps:
            raise ValueError(f"the checkpoint {resume['checkpoint']} is at step {version}, "
                             f"already run.steps = {cfg.run.steps}: raise run.steps to continue")
        log(rt, f"resumed from {resume['checkpoint']} at step {meta['step']}")
        sender.publish(model, version)  # generators continue from the restored policy
    per_engine = cfg.generator.prompts_per_step // rt.layout.engines
    run_t0 = time.perf_counter()
    for step in range(version, cfg.run.steps):
        t_step = time.perf_counter()
        waits = [ch.wait_s for ch in channels]
        with timeline.phase("wait_rollouts", step):
            parts = [ch.get() for ch in channels]
        wait_s = sum(ch.wait_s for ch in channels) - sum(waits)
        transfer_s = time.perf_counter() - t_step - wait_s
        batch, dropped = drop_stale(RolloutBatch.concat(parts), version, k)

        t0 = time.perf_counter()
        with timeline.phase("train", step):
            stats = policy_step(trainer, batch, cfg, tokenizer.pad_token_id, version, dropped,
                                reference)
        train_s = time.perf_counter() - t0
        dropped_total += int(stats["dropped"])

        t0 = time.perf_counter()
        version += 1
        last = step + 1 == cfg.run.steps
        if last and r == 0:
            rt.store.set("trainer/final_version", str(version))  # generators stop after it
        if last or version % cfg.sync.every == 0:
            with timeline.phase("sync", step):
                sender.publish(model, version)  # pack now, broadcast in the background
        sync_s = time.perf_counter() - t0
        every = cfg.run.checkpoint_every
        if every and (version % every == 0 or last):
            with timeline.phase("checkpoint", step):
                checkpoint.save(rt.run_dir, version, model, trainer.opt, trainer.sched, keep=
                                cfg.run.keep_checkpoints, meta={
                                    "policy_version": version, "model_path": model_path,
                                    "prompts_consumed_per_engine": version * per_engine})

        info = [p.info for p in parts]
        by_engine = {int(p.generator[0]): int(p.policy_version.min()) for p in parts if len(p)}
        n_tok = max(stats["n_tokens"], 1.0)
        row = {
            "step": step + 1, "policy_version": version,
            "reward_mean": stats["reward_sum"] / max(stats["n_seqs"], 1.0),
            "loss": stats["loss"], "grad_norm": stats["grad_norm"], "lr": stats["lr"],
            "clip_frac": stats.get("corrected", 0.0) / n_tok,
            "mismatch_kl": stats.get("mismatch_kl", 0.0) / n_tok,
            "entropy": stats.get("entropy_sum", 0.0) / n_tok,
            "kl_ref": stats.get("kl_ref", 0.0) / n_tok,
            "ratio_mean": stats.get("ratio_sum", 0.0) / n_tok,
            "ratio_max": stats.get("ratio_max", 0.0), "ratio_min": stats.get("ratio_min", 0.0),
            "staleness_mean": stats["staleness_sum"] / max(stats["n_seqs"], 1.0),
            "staleness_max": stats["staleness_max"],
            "dropped_stale": int(stats["dropped"]), "dropped_stale_total": dropped_total,
            "batch_digest": hashlib.sha1(batch.prompt_ids.numpy().tobytes()).hexdigest()[:12]
            if batch is not None else "",
            "behaviour_version_by_engine": by_engine,
            "response_len": stats["n_tokens"] / max(stats["n_seqs"], 1.0),
            "finished_frac": stats["finished"] / max(stats["n_seqs"], 1.0),
            "tokens_generated": int(stats["n_tokens"]),
            "generate_s": max(i["generate_s"] for i in info),
            "reward_s": max(i["reward_s"] for i in info),
            "wait_s": wait_s, "transfer_s": transfer_s, "train_s": train_s, "sync_s": sync_s,
            "train_tokens_per_s": stats["n_tokens_all"] / max(train_s, 1e-9),
            # buffer cost: this rank's reads + the producers' writes (of the previous batch)
            "buffer_s": transfer_s + sum(i.get("prev_put_s", 0.0) for i in info),
            "broadcast_s": sender.last_broadcast_s,
            "step_time_s": time.perf_counter() - t_step,
            "elapsed_s": time.perf_counter() - run_t0,
        }
        row.update(reward_metrics(info))  # reward errors/timeouts, dynamic sampling, components
        row["skipped_steps_total"] = int(stats["skipped_total"])
        if "skipped" in stats:
            row["skipped_step"] = 1
        if metrics is not None:
            metrics.write(row)
            if (step + 1) % cfg.run.log_every == 0 or step + 1 == cfg.run.steps:
                log(rt, metrics.line(row, cfg.run.steps))

    sender.wait()
    final_dir = rt.run_dir / "policy"
    save_policy(model, model_path, final_dir, r == 0)
    if r == 0:
        summarize(rt, final_dir)


def drop_stale(batch: RolloutBatch, version: int, max_staleness: int):
    """Keep samples at most `max_staleness` versions older than `version`. Returns the kept
    batch (or None if nothing is left) and the dropped one (or None)."""
    fresh = (version - batch.policy_version) <= max_staleness
    if bool(fresh.all()):
        return batch, None
    keep = fresh.nonzero().flatten().tolist()
    drop = (~fresh).nonzero().flatten().tolist()
    return (batch.select(keep) if keep else None), batch.select(drop)


def policy_step(trainer: PolicyTrainer, batch: RolloutBatch | None, cfg, pad_id: int,
              version: int = 0, filler: RolloutBatch | None = None,
              reference: torch.nn.Module | None = None) -> dict:
    """One policy-gradient optimizer step (advantages: algorithm.name) on this rank's share of
    the global batch; `filler` holds the samples dropped as stale (counted, and used only as
    masked filler).

    Every trainer rank must run the same number of micro-batches (FSDP2 collectives), so a
    rank whose batch is short (stale samples dropped) runs masked filler micro-batches that
    contribute nothing to the gradient.
    """
    mb = cfg.trainer.micro_batch_size
    chunks = []
    if batch is not None:
        adv = compute_advantages(cfg.algorithm.name, batch.rewards, batch.group_ids,
                                 batch.completion_lens, cfg.algorithm.adv_eps, _all_reduce_sum)
        seqs = batch.sequences()
        chunks = [(collate(seqs[i:i + mb], pad_id), adv[i:i + mb])
                  for i in range(0, len(seqs), mb)]
    n = len(batch) if batch is not None else 0
    stale = (version - batch.policy_version) if batch is not None else torch.zeros(1)
    all_tokens = float(batch.prompt_lens.sum() + batch.completion_lens.sum()) if n else 0.0
    local = torch.tensor([float(batch.completion_lens.sum()) if n else 0.0, float(n),
                          float(batch.rewards.sum()) if n else 0.0,
                          float(batch.finished.sum()) if n else 0.0,
                          float(stale.sum()) if n else 0.0,
                          float(len(filler)) if filler is not None else 0.0, all_tokens])
    counts = torch.tensor([float(stale.max()) if n else 0.0, float(len(chunks))])
    if dist.is_initialized():
        dist.all_reduce(local)  # every rank needs the global normaliser
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    n_tokens, n_seqs, reward_sum, finished, stale_sum, dropped, n_all = local.tolist()
    staleness_max, n_micro = counts.tolist()
    while len(chunks) < int(n_micro):  # masked filler: same collectives, zero gradient
        chunks.append(_filler_chunk(batch if batch is not None else filler, pad_id))
    n_tokens_norm = max(n_tokens, 1.0)
    n_seqs_norm = max(n_seqs, 1.0)
    norm = {"token_mean": n_tokens_norm, "seq_mean_token_mean": n_seqs_norm,
            # Dr. GRPO: a constant, N_seqs x the longest allowed response
            "seq_sum_constant": n_seqs_norm * cfg.generator.max_new_tokens}[cfg.algorithm.loss_agg]

    alg = cfg.algorithm

    def loss_fn(logp, mbatch, i, entropy):
        loss, stats = policy_loss(logp, mbatch.old_logp, chunks[i][1].to(logp.device),
                                  mbatch.mask, alg, norm)
        if reference is not None:  # L += beta * KL(pi_theta || pi_ref), per-token estimator
            with torch.no_grad():
                ref_logp, _ = token_logprobs(reference, mbatch, trainer.temperature)
            kl = kl_estimate(logp, ref_logp, alg.kl_estimator)
            loss = loss + alg.kl_coef * aggregate(kl, mbatch.mask, alg.loss_agg, norm)
            stats["kl_ref"] = (kl.detach() * mbatch.mask).sum()
        if alg.entropy_coef > 0:  # L -= c * H: keeps the policy from collapsing early
            loss = loss - alg.entropy_coef * aggregate(entropy, mbatch.mask, alg.loss_agg, norm)
        return loss, stats

    stats = trainer.step([c[0] for c in chunks], loss_fn)
    stats.update(n_tokens=n_tokens, n_seqs=n_seqs, reward_sum=reward_sum, finished=finished,
                 staleness_sum=stale_sum, staleness_max=staleness_max, dropped=dropped,
                 n_tokens_all=n_all)
    return stats


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the trainer ranks (global-batch statistics of an estimator)."""
    if dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t)
    return t


def _filler_chunk(source: RolloutBatch, pad_id: int):
    """One sequence of `source` with its loss mask zeroed."""
    p, c, lp = source.sequences()[0]
    tb = collate([(p, c, lp)], pad_id)
    tb.mask.zero_()
    return tb, torch.zeros(1)


def save_policy(model: torch.nn.Module, src_dir: str, out_dir: Path, writer: bool) -> None:
    """Gather the full weights (collective) and write a HF directory loadable by transformers
    and vLLM (safetensors + config + tokenizer)."""
    from transformers import AutoConfig, AutoTokenizer

    from llamarl.tiny.model import save_hf_dir

    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
             for k, v in model.state_dict().items()}
    if writer:
        save_hf_dir(out_dir, state, AutoConfig.from_pretrained(src_dir),
                    AutoTokenizer.from_pretrained(src_dir))
    dist.barrier()


def summarize(rt: Runtime, final_dir: Path) -> None:
    after = json.loads(rt.wait_key(f"eval/result/{rt.cfg.run.steps}"))
    before = json.loads((rt.run_dir / "eval.jsonl").read_text().splitlines()[0])
    log(rt, f"held-out reward (sampled, T={rt.cfg.generator.temperature}): "
            f"before {before['reward_mean']:.3f} -> after {after['reward_mean']:.3f} "
            f"(greedy {before['reward_mean_greedy']:.3f} -> {after['reward_mean_greedy']:.3f})")
    log(rt, f"final policy: {final_dir}")
    print(f"run directory: {rt.run_dir}", flush=True)
