"""Many LoRA tenants on one frozen base model: the training side of the Tinker service.

The base model is loaded once and never updated. Each tenant (a Tinker "training client",
its model id) owns a named PEFT adapter injected into the same linear layers, its AdamW state
and its accumulated gradients:

    y = W x + (alpha / r_t) B_t (A_t x)        for the active tenant t only

Tenants run **one after another**: an operation activates its tenant's adapter (PEFT's
set_adapter; the other adapters are not computed at all, not multiplied by zero) and runs
the batch. Why not one batch across tenants: their sequences differ in length and loss, and
on the machines this serves first (a CPU, a GPU shared by a few tenants) a tenant's
forward-backward already fills the device; one after another also makes a tenant's numbers
independent of who else is training: its losses and weights are bitwise those of training it
alone (tested), which batching would not give (different padding, different reductions).

Gradients accumulate in each tenant's own adapter parameters across `forward_backward`
calls until its `optim_step` (the adapters of different tenants are different parameters,
so nothing needs to be swapped: only which adapter is active).

Datums: position i of `tokens` [N] predicts `target_tokens[i]`; the model runs on the
tokens right-padded to the longest datum plus one (`_datum_batch`), so that llamarl's
chunked log-softmax (trainer/policy.py: token_logprobs) scores all N positions.
"""

from __future__ import annotations

import copy
import threading
import warnings
from dataclasses import dataclass

import torch

from llamarl.service.losses import LOSSES, check_inputs, check_loss
from llamarl.trainer.policy import TokenBatch, token_logprobs

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
LORA_ALPHA = 32  # scale alpha / r, as Tinker's LoRA: the learning rate does not follow the rank


@dataclass(frozen=True)
class LoraSpec:
    """A tenant's adapter, as the SDK's LoraConfig gives it."""

    rank: int
    seed: int
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def __post_init__(self):
        if not 1 <= self.rank <= 256:
            raise ValueError(f"lora rank {self.rank}: give 1 to 256")
        if not (self.train_mlp or self.train_attn or self.train_unembed):
            raise ValueError("lora_config trains nothing: set train_mlp, train_attn or "
                             "train_unembed")

    def target_modules(self) -> list[str]:
        return [*(ATTN_MODULES if self.train_attn else ()), *(MLP_MODULES if self.train_mlp
                                                              else ()),
                *(UNEMBED_MODULES if self.train_unembed else ())]


@dataclass(frozen=True)
class AdamStep:
    """One optim_step's hyperparameters (the SDK's AdamParams): AdamW, decoupled decay."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def __post_init__(self):
        if not self.learning_rate >= 0:
            raise ValueError(f"learning_rate {self.learning_rate}: give a value >= 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)}: give a value in [0, 1)")
        if not self.eps > 0:
            raise ValueError(f"eps {self.eps}: give a value > 0")


@dataclass
class Datum:
    """One Tinker datum: tokens [N] (int64) and its loss_fn_inputs, each [N]
    (target_tokens int64, the others float32)."""

    tokens: torch.Tensor
    inputs: dict[str, torch.Tensor]


@dataclass
class ForwardResult:
    """Per datum its target logprobs [N] (float32); the sum of the data's losses (None for a
    forward without a loss)."""

    logprobs: list[torch.Tensor]
    loss: float | None


class Tenant:
    """One adapter: its name in the model, its spec, its optimizer and how many
    forward_backward calls have accumulated since its last step."""

    def __init__(self, name: str, spec: LoraSpec, params: list[torch.nn.Parameter]):
        self.name, self.spec, self.params = name, spec, params
        self.optimizer = torch.optim.AdamW(params, lr=0.0)
        self.pending = 0  # forward_backward calls since the last optim_step
        self.steps = 0


class LoraTenants:
    """Tenants on one base `model` (a Hugging Face causal LM, frozen here), at most
    `max_tenants` at once, datums of at most `max_tokens` positions. Every method is safe to
    call from several threads: one operation runs at a time (`lock`)."""

    def __init__(self, model: torch.nn.Module, max_tenants: int, max_tokens: int,
                 pad_id: int, micro_batch_tokens: int = 4096):
        if max_tenants < 1:
            raise ValueError(f"max tenants {max_tenants}: give at least 1")
        self.model, self.max_tenants, self.max_tokens = model, max_tenants, max_tokens
        self.pad_id = pad_id
        self.micro_batch_tokens = max(micro_batch_tokens, max_tokens + 1)
        self.vocab = model.config.vocab_size
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()  # (no dropout anywhere: the adapters' is 0)
        self.tenants: dict[str, Tenant] = {}
        self.lock = threading.RLock()
        self._active: str | None = None

    # --- tenants -------------------------------------------------------------------------

    def create(self, name: str, spec: LoraSpec) -> Tenant:
        """Inject a fresh adapter `name` (A Kaiming-uniform from a generator seeded with
        spec.seed, B = 0: the tenant starts as the base model)."""
        from peft import LoraConfig, inject_adapter_in_model

        with self.lock:
            self.check_create(name)
            config = LoraConfig(r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                target_modules=spec.target_modules(), bias="none")
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                # (PEFT warns of a second adapter, which is the point here, and of a LoRA on
                # a tied head, which is never merged into the shared weight here)
                warnings.simplefilter("ignore", UserWarning)
                torch.manual_seed(spec.seed)
                inject_adapter_in_model(config, self.model, adapter_name=name)
            params = [p for n, p in self.model.named_parameters()
                      if f".{name}." in n and ".lora_" in n]
            assert params, f"adapter {name} injected no parameters"
            for p in params:
                p.data = p.data.float()  # (the master copy: float32 whatever the base)
            tenant = Tenant(name, spec, params)
            self.tenants[name] = tenant
            self._active = None  # injection may have changed which adapters are active
            return tenant

    def check_create(self, name: str) -> None:
        """A ValueError when a tenant `name` cannot be created now."""
        if name in self.tenants:
            raise ValueError(f"model {name!r} exists already")
        if len(self.tenants) >= self.max_tenants:
            raise ValueError(f"this server holds at most {self.max_tenants} LoRA models "
                             f"and has {len(self.tenants)}: unload one (or raise "
                             "service.max_tenants)")

    def remove(self, name: str) -> None:
        from peft.tuners.tuners_utils import delete_adapter

        with self.lock:
            self.get(name)
            with warnings.catch_warnings():  # (which adapter becomes active: set per call)
                warnings.simplefilter("ignore", UserWarning)
                delete_adapter(self.model, name, prefix="lora_")
            del self.tenants[name]
            self._active = None

    def get(self, name: str) -> Tenant:
        tenant = self.tenants.get(name)
        if tenant is None:
            raise KeyError(f"no model {name!r} on this server: create it "
                           "(create_lora_training_client) or load its state")
        return tenant

    def _activate(self, name: str) -> None:
        from peft.tuners.tuners_utils import set_adapter

        if self._active != name:
            set_adapter(self.model, name)
            self._active = name

    # --- forward / backward / step -------------------------------------------------------

    def check(self, data: list[Datum], loss_fn: str | None, config: dict | None) -> None:
        """A ValueError naming the first thing wrong with a request, before any compute."""
        if not data:
            raise ValueError("no data: give at least one datum")
        if loss_fn is not None:
            check_loss(loss_fn, config)
        for i, d in enumerate(data):
            n = len(d.tokens)
            if n == 0:
                raise ValueError(f"data[{i}].model_input is empty: give at least one token")
            if n > self.max_tokens:
                raise ValueError(f"data[{i}] has {n} tokens, over this server's "
                                 f"{self.max_tokens}: shorten it (or raise "
                                 "service.max_tokens)")
            for key, ids in (("model_input", d.tokens),
                             ("loss_fn_inputs['target_tokens']", d.inputs.get("target_tokens"))):
                if ids is not None and len(ids) and (int(ids.min()) < 0
                                                     or int(ids.max()) >= self.vocab):
                    raise ValueError(f"data[{i}].{key} has a token id outside the vocabulary "
                                     f"[0, {self.vocab}): {int(ids.min())}..{int(ids.max())}")
            if loss_fn is not None:
                check_inputs(loss_fn, n, d.inputs, i)
            elif "target_tokens" not in d.inputs:
                raise ValueError(f"data[{i}].loss_fn_inputs has no 'target_tokens': give the "
                                 "token each position predicts")

    def forward(self, name: str, data: list[Datum], loss_fn: str | None = None,
                config: dict | None = None, backward: bool = False) -> ForwardResult:
        """Each datum's target logprobs; with `loss_fn`, the summed loss, and with `backward`
        its gradient added to the tenant's accumulated one. The data run in micro-batches of
        at most `micro_batch_tokens` padded positions (`micro_batches`), each one's backward
        before the next one's forward: the activations held are one micro-batch's (a step's
        128 sequences of SmolLM2 at once held 13 GiB)."""
        self.check(data, loss_fn, config)
        with self.lock:
            tenant = self.get(name)
            self._activate(name)
            per_datum: list[torch.Tensor] = []
            loss = None if loss_fn is None else 0.0
            for part in micro_batches(data, self.micro_batch_tokens):
                batch, lengths = _datum_batch(part, self.pad_id)
                with torch.set_grad_enabled(backward):
                    lp, _ = token_logprobs(self.model, batch, 1.0)
                    lps = [lp[i, :n] for i, n in enumerate(lengths)]
                    if loss_fn is not None:
                        fn = LOSSES[loss_fn][0]
                        total = sum(fn(lp_i, d.inputs, config or {})
                                    for lp_i, d in zip(lps, part))
                        if backward:
                            total.backward()
                        loss += float(total.detach())
                per_datum += [x.detach().float() for x in lps]
            if backward and loss_fn is not None:
                tenant.pending += 1
            return ForwardResult(per_datum, loss)

    def optim_step(self, name: str, step: AdamStep) -> dict[str, float]:
        """One AdamW step of the tenant's adapter on its accumulated gradient (none
        accumulated: the step still counts, with zero gradients, as an optimizer would take
        it), then the gradient is cleared."""
        with self.lock:
            tenant = self.get(name)
            for group in tenant.optimizer.param_groups:
                group.update(lr=step.learning_rate, betas=(step.beta1, step.beta2),
                             eps=step.eps, weight_decay=step.weight_decay)
            for p in tenant.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            norm = torch.nn.utils.clip_grad_norm_(
                tenant.params, step.grad_clip_norm if step.grad_clip_norm > 0 else float("inf"))
            tenant.optimizer.step()
            tenant.optimizer.zero_grad(set_to_none=True)
            tenant.pending, tenant.steps = 0, tenant.steps + 1
            return {"grad_norm:mean": float(norm), "step:max": float(tenant.steps)}

    # --- state ---------------------------------------------------------------------------

    def adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        """The tenant's adapter in PEFT's file layout (`base_model.model.<module>.lora_A.weight`,
        what vLLM's LoRA loader and PEFT's from_pretrained read)."""
        from peft import get_peft_model_state_dict

        with self.lock:
            self.get(name)
            state = get_peft_model_state_dict(self.model, adapter_name=name,
                                              save_embedding_layers=False)
            return {f"base_model.model.{k}": v.detach().clone() for k, v in state.items()}

    def peft_config(self, name: str) -> dict:
        """adapter_config.json for the tenant's adapter."""
        spec = self.get(name).spec
        return {"peft_type": "LORA", "r": spec.rank, "lora_alpha": LORA_ALPHA,
                "lora_dropout": 0.0, "target_modules": spec.target_modules(), "bias": "none",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": getattr(self.model.config, "_name_or_path", "")}

    def state(self, name: str, with_optimizer: bool) -> dict:
        """What save_state writes: the adapter's parameters (by their name in the model),
        the optimizer's state when asked, the step count."""
        with self.lock:
            tenant = self.get(name)
            out = {"spec": tenant.spec.__dict__, "steps": tenant.steps,
                   "params": [p.detach().clone() for p in tenant.params]}
            if with_optimizer:
                out["optimizer"] = copy.deepcopy(tenant.optimizer.state_dict())  # (a
                # state_dict holds the live moment tensors, which the next step changes)
            return out

    def load_state(self, name: str, state: dict, with_optimizer: bool) -> None:
        """Set the tenant's adapter (and optimizer, when asked and saved) from `state`."""
        with self.lock:
            tenant = self.get(name)
            params = state["params"]
            if len(params) != len(tenant.params) or any(
                    a.shape != b.shape for a, b in zip(params, tenant.params)):
                raise ValueError(f"the saved state is of another adapter shape (rank "
                                 f"{state['spec']['rank']}, modules "
                                 f"{LoraSpec(**state['spec']).target_modules()}) than model "
                                 f"{name!r}: create the model with the saved LoRA config")
            with torch.no_grad():
                for p, v in zip(tenant.params, params):
                    p.copy_(v)
            tenant.steps = int(state["steps"])
            tenant.optimizer.zero_grad(set_to_none=True)
            tenant.pending = 0
            if with_optimizer:
                if "optimizer" not in state:
                    raise ValueError("the state was saved without its optimizer: load it with "
                                     "load_state (weights only), not "
                                     "load_state_with_optimizer")
                tenant.optimizer.load_state_dict(state["optimizer"])
            else:
                tenant.optimizer = torch.optim.AdamW(tenant.params, lr=0.0)


def micro_batches(data: list[Datum], budget: int) -> list[list[Datum]]:
    """`data` cut in order into runs whose padded size, (datums) x (longest + 1), is at most
    `budget` positions (a datum longer than that alone)."""
    out: list[list[Datum]] = []
    run: list[Datum] = []
    longest = 0
    for d in data:
        width = max(longest, len(d.tokens)) + 1
        if run and (len(run) + 1) * width > budget:
            out.append(run)
            run, longest = [], 0
        run.append(d)
        longest = max(longest, len(d.tokens))
    if run:
        out.append(run)
    return out


def _datum_batch(data: list[Datum], pad_id: int) -> tuple[TokenBatch, list[int]]:
    """The data right-padded to [B, N_max + 1] (one more column so that position N-1 is
    scored), targets [B, N_max] = each datum's target_tokens (0 past its end)."""
    lengths = [len(d.tokens) for d in data]
    B, N = len(data), max(lengths)
    ids = torch.full((B, N + 1), pad_id, dtype=torch.long)
    attn = torch.zeros((B, N + 1), dtype=torch.long)
    targets = torch.zeros((B, N), dtype=torch.long)
    for i, (d, n) in enumerate(zip(data, lengths)):
        ids[i, :n] = d.tokens
        attn[i, :n] = 1
        targets[i, :n] = d.inputs["target_tokens"]
    mask = torch.zeros((B, N), dtype=torch.float32)
    return TokenBatch(ids, attn, targets, mask, torch.zeros_like(mask)), lengths
