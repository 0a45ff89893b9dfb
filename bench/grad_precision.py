"""How close is one GRPO update's gradient, in each precision, to the float32 gradient?

The SmolLM2 recipe learns more slowly per step in bfloat16 than in float32 or than TRL under
bf16 autocast (docs/measured/smollm2_vs_trl.md). This measures the trainer's side of that on
one real batch: 16 training prompts of `recipes/smollm2_add_cpu.yaml` (chat-templated), 8
completions each sampled at T = 1 from the float32 model (HF `generate`), rewarded by the
`numeric` verifier, with the float32 model's logprobs as the behaviour logprobs (ratio 1:
on-policy). Gradients of the recipe's loss (GRPO advantages, PPO clip, token_mean) over the
whole batch:

* `hf_float32`: transformers' model in float32, plain autograd (the reference, G);
* `hf_autocast`: the same under `torch.autocast("cpu", bfloat16)` (TRL's bf16 precision);
* `llamarl_float32` and `llamarl_bfloat16`: llamarl's own update (`policy_step`: FSDP2 over
  float32 masters, shared prompts, the chunked LM head) with its optimizer step left out.

For each: cos(g, G) and |g| / |G| over all parameters and per kind (embedding, norms,
attention, MLP), and the loss. A precision whose gradient points away from G learns less per
step at the same learning rate (Adam normalises the scale, not the direction).

    torchrun --standalone --nproc-per-node 1 bench/grad_precision.py [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist


def kind(name: str) -> str:
    if "embed" in name or "lm_head" in name:
        return "embedding"
    if "norm" in name:
        return "norms"
    if "self_attn" in name:
        return "attention"
    return "mlp"


def compare(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
    out = {}
    for k in ("all", "embedding", "norms", "attention", "mlp"):
        names = [n for n in ref if k == "all" or kind(n) == k]
        g = torch.cat([grads[n].flatten().double() for n in names])
        r = torch.cat([ref[n].flatten().double() for n in names])
        out[k] = {"cos": float(g @ r / (g.norm() * r.norm())),
                  "norm_ratio": float(g.norm() / r.norm())}
    return out


def sample_logprobs(model, prompt: list[int], completion: list[int],
                    autocast: bool = False) -> torch.Tensor:
    """log pi(y_t) of each completion token [len(completion)], float32 softmax over the model's
    logits (under bf16 autocast when `autocast`); differentiable where grad is enabled."""
    full = torch.tensor([prompt + completion])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(full).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(
        -1, torch.tensor(completion)[:, None])[:, 0]


def grpo_advantages(R, G, C, cfg) -> torch.Tensor:
    """The recipe's per-sample GRPO advantages [B] (llamarl's own estimator)."""
    from llamarl.algorithms.advantages import compute_advantages
    return compute_advantages("grpo", torch.tensor(R), torch.tensor(G),
                              torch.tensor([len(c) for c in C]), cfg.algorithm.adv_eps,
                              lambda t: t)


@torch.no_grad()
def completion_logprobs(model, P, C, precision: str) -> list[torch.Tensor]:
    """Each sample's completion-token logprobs [len(C[j])] under `precision`: float32,
    autocast (bf16 products over float32 weights, activations and norms: TRL's), or bfloat16
    (a bfloat16 copy of the model: bfloat16 weights and activations, as llamarl's engine and
    trainer compute)."""
    m = model
    if precision == "bfloat16":
        import copy
        m = copy.deepcopy(model).to(torch.bfloat16)
    return [sample_logprobs(m, p, c, precision == "autocast") for p, c in zip(P, C)]


@torch.no_grad()
def realized_change(model, grad, P, C, R, G, cfg) -> dict:
    """The policy change of k Adam-like steps along the float32 gradient (Adam's first step is
    lr x sign(g) per element; k steps in one direction: w - k lr sign(g)), as each precision
    sees it: per token d_t = log pi_{w'}(y_t) - log pi_w(y_t), compared with float32's d by
    cosine and by the surrogate gain sum_t A_t d_t / tokens (what the step buys on this
    batch's objective, to first order)."""
    adv = grpo_advantages(R, G, C, cfg)
    a_tok = torch.cat([torch.full((len(c),), float(adv[j])) for j, c in enumerate(C)])
    n_tok = a_tok.numel()
    params = dict(model.named_parameters())
    w0 = {n: p.detach().clone() for n, p in params.items()}
    base = {pr: torch.cat(completion_logprobs(model, P, C, pr))
            for pr in ("float32", "autocast", "bfloat16")}
    out = {}
    for k in (1, 5, 10, 20):
        for n, p in params.items():
            if n in grad:
                p.copy_(w0[n] - k * cfg.trainer.lr * grad[n].sign())
        d = {pr: torch.cat(completion_logprobs(model, P, C, pr)) - base[pr] for pr in base}
        ref = d["float32"]
        out[f"k{k}"] = {pr: {"surrogate_gain": float((a_tok * v).sum() / n_tok),
                             "cos_to_float32": float(v @ ref / (v.norm() * ref.norm())),
                             "norm_ratio": float(v.norm() / ref.norm())}
                        for pr, v in d.items()}
        print(f"k={k}: " + ", ".join(f"{pr} gain {o['surrogate_gain']:.3e} cos "
                                     f"{o['cos_to_float32']:.3f}"
                                     for pr, o in out[f"k{k}"].items()),
              file=sys.stderr, flush=True)
    for n, p in params.items():
        p.copy_(w0[n])
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    args = p.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llamarl.buffer.record import RolloutBatch
    from llamarl.config import load_config
    from llamarl.data.dataset import load_prompt_data
    from llamarl.data.prompts import PromptFormatter
    from llamarl.models.smollm2 import ensure_smollm2
    from llamarl.rewards.registry import resolve_builtin
    from llamarl.runtime.allocator import keep_freed_memory
    from llamarl.trainer.policy import DTYPES, load_policy, shard_for_training
    from llamarl.trainer.rl_step import policy_step
    from llamarl.trainer.step import PolicyTrainer

    keep_freed_memory()
    dist.init_process_group("gloo")
    torch.set_num_threads(os.cpu_count() or 1)
    path = str(ensure_smollm2("135m-instruct"))
    recipe = "recipes/smollm2_add_cpu.yaml"
    cfg = load_config(recipe, ["trainer.grad_clip=0", f"run.seed={args.seed}"])
    tok = AutoTokenizer.from_pretrained(path)
    data = load_prompt_data(cfg.data, args.seed)
    fmt = PromptFormatter(tok, cfg.data.chat_template, cfg.data.system_prompt)
    g = cfg.generator
    examples = data.train[:g.prompts_per_step]
    prompts = fmt.encode(examples)
    score = resolve_builtin("numeric", cfg.reward.format_pattern)

    # -- a real batch, sampled from the float32 model -----------------------------------
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(args.seed)
    P, C, LP, R, G = [], [], [], [], []
    eos = tok.eos_token_id
    for i, pr in enumerate(prompts):
        ids = torch.tensor([pr.token_ids])
        with torch.no_grad():
            out = ref_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=1.0, top_p=1.0, top_k=0,
                                     max_new_tokens=g.max_new_tokens,
                                     num_return_sequences=g.samples_per_prompt,
                                     pad_token_id=tok.pad_token_id)
        for row in out[:, ids.shape[1]:].tolist():
            comp = row[:row.index(eos) + 1] if eos in row else row
            with torch.no_grad():
                lp = sample_logprobs(ref_model, pr.token_ids, comp)
            P.append(pr.token_ids)
            C.append(comp)
            LP.append(lp.tolist())
            R.append(float(score(tok.decode(comp, skip_special_tokens=True), pr.answer,
                                 pr.text)))
            G.append(i)
    batch = RolloutBatch.from_lists(P, C, LP, R, G, [c[-1] == eos for c in C], 0, 0)
    print(f"batch: {len(C)} samples, {sum(map(len, C))} completion tokens, "
          f"mean reward {sum(R) / len(R):.3f}", file=sys.stderr, flush=True)

    # -- the reference loss, as the recipe defines it (ratio 1 at the behaviour policy) --
    def hf_grads(model, autocast: bool) -> tuple[dict, float]:
        model.zero_grad(set_to_none=True)
        adv = grpo_advantages(R, G, C, cfg)
        n_tok = sum(map(len, C))
        total = 0.0
        for j in range(len(C)):
            lp = sample_logprobs(model, P[j], C[j], autocast)
            ratio = torch.exp(lp - torch.tensor(LP[j]))
            eps = cfg.algorithm.clip_eps
            loss = -torch.minimum(ratio * adv[j], ratio.clamp(1 - eps, 1 + eps) * adv[j]).sum()
            (loss / n_tok).backward()
            total += float(loss) / n_tok
        return ({n: p.grad.detach().clone() for n, p in model.named_parameters()
                 if p.grad is not None}, total)

    results = {}
    ref, loss = hf_grads(ref_model, False)
    results["hf_float32"] = {"loss": loss}
    ac, loss = hf_grads(ref_model, True)
    results["hf_autocast"] = {"loss": loss, **compare(ac, ref)}
    ref_model.zero_grad(set_to_none=True)
    results["realized"] = realized_change(ref_model, ref, P, C, R, G, cfg)
    print(json.dumps(results["realized"], indent=1), file=sys.stderr, flush=True)
    del ref_model

    mesh = init_device_mesh("cpu", (1,))
    for dtype in ("float32", "bfloat16"):
        run_cfg = load_config(recipe, ["trainer.grad_clip=0", f"model.dtype={dtype}"])
        model = load_policy(path, "float32")
        shard_for_training(model, mesh, run_cfg.trainer, DTYPES[dtype])
        trainer = PolicyTrainer(model, run_cfg.trainer, 10, 1, torch.device("cpu"))
        trainer.opt.step = lambda *a, **k: None  # the gradient only
        stats = policy_step(trainer, batch, run_cfg, tok.pad_token_id)
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                 for n, p in model.named_parameters() if p.grad is not None}
        # a tied head: transformers' named_parameters lists it once, as the embedding
        grads = {n: grads[n] for n in ref}
        results[f"llamarl_{dtype}"] = {"loss": stats["loss"], **compare(grads, ref)}
        del model, trainer
    print(json.dumps(results, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"seed": args.seed, "results": results}, f, indent=1)
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
