"""One vLLM engine per generator: construction under the process-group rule, sampling with the
sampled tokens' logprobs, and weight loads.

Process-group rule (DESIGN.md): the generator process never joins a world-wide default group.
With tp = 1 the engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, fastest here); its
private one-rank world must not pick up torchrun's agent store, so
`TORCHELASTIC_USE_AGENT_STORE` is removed first. With tp > 1 every tp rank of the engine is its
own launcher rank and drives the same engine SPMD-style (vLLM's `external_launcher` backend) in a
world private to the engine: RANK/WORLD_SIZE/MASTER_* are rewritten to the engine's own before
vLLM reads them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from llamarl.config import GeneratorConfig
from llamarl.generator.cpu_fixes import disable_onednn_prepack

WORKER_EXTENSION = "llamarl.generator.worker_ext.LlamarlWorkerExtension"


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # log pi_behaviour(token_t | prefix), after temperature
    finish_reason: str  # "stop" (EOS) | "length"
    text: str


@dataclass(frozen=True)
class EngineWorld:
    """The private torch.distributed world of one tp>1 engine."""

    tp_rank: int
    tp: int
    master_addr: str
    master_port: int
    local_rank: int


def prepare_environment(world: EngineWorld | None, on_cpu: bool) -> None:
    """Set the environment vLLM reads at engine start (call before importing vllm)."""
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not one INFO line per weight load
    if on_cpu:
        # Several ranks share the cores; vLLM must not pin its OpenMP threads to all of them.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if world is None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
            os.environ.pop(key, None)
    else:
        os.environ.update(RANK=str(world.tp_rank), WORLD_SIZE=str(world.tp),
                          LOCAL_RANK=str(world.local_rank), MASTER_ADDR=world.master_addr,
                          MASTER_PORT=str(world.master_port))


class Engine:
    def __init__(self, model_path: str, cfg: GeneratorConfig, dtype: str, seed: int,
                 on_cpu: bool, world: EngineWorld | None = None):
        prepare_environment(world, on_cpu)
        if on_cpu:
            disable_onednn_prepack()
        from vllm import LLM

        memory = ({"kv_cache_memory_bytes": int(cfg.kv_cache_gib * (1 << 30))} if on_cpu
                  else {"gpu_memory_utilization": cfg.gpu_memory_utilization})
        extra = {}
        if cfg.tp > 1:
            extra["distributed_executor_backend"] = "external_launcher"
        if cfg.block_size:
            extra["block_size"] = cfg.block_size
        self.cfg = cfg
        self.llm = LLM(
            model=model_path, dtype=dtype, seed=seed, tensor_parallel_size=cfg.tp,
            max_model_len=cfg.max_model_len, enforce_eager=cfg.enforce_eager,
            worker_extension_cls=WORKER_EXTENSION, logprobs_mode="processed_logprobs",
            enable_prefix_caching=True, **memory, **extra)
        self.tokenizer = self.llm.get_tokenizer()
        # The vLLM worker runs in this process (tp = 1 in-process, or this process's tp rank
        # under the external launcher), so the weight sync calls it directly: collective_rpc's
        # layers cost ~0.1 ms a call on the 2-core CPU, 5% of a tiny model's sync.
        self.worker = self.llm.collective_rpc("llamarl_worker")[0]
        # Set by every weight load: the prefix cache holds KV computed with the old weights,
        # and the next generate empties it first (see load_posted_weights).
        self._stale_prefix_cache = False

    def generate(self, prompts: list[list[int]], n: int, temperature: float, max_tokens: int,
                 seed: int | None = None) -> list[list[Completion]]:
        """Sample `n` completions per prompt (token ids). Returns one group per prompt.

        top_p = 1 and top_k disabled, so the returned logprobs are those of the plain
        temperature-scaled softmax, which is what the trainer recomputes.
        """
        from vllm import SamplingParams, TokensPrompt

        if self._stale_prefix_cache:  # never reuse KV computed with older weights
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache (requests running?): "
                                   "generating now would reuse KV of the old weights")
            self._stale_prefix_cache = False
        params = SamplingParams(n=n, temperature=temperature, top_p=1.0, top_k=0,
                                max_tokens=max_tokens, logprobs=0, seed=seed)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                    use_tqdm=False)
        groups = []
        for out in outputs:
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [step[tok].logprob for tok, step in zip(ids, c.logprobs)]
                group.append(Completion(ids, lps, c.finish_reason or "length", c.text))
            groups.append(group)
        return groups

    def join_weight_group(self, specs: list, metas_json: list[str], bucket_mb: int,
                          solo_mb: float | None = None) -> None:
        """Join trainer rank i's weight group `specs[i]`, whose shard layout is metas_json[i]
        (bucketed as the senders do: sync.bucket_mb, sync.solo_mb)."""
        self.llm.collective_rpc("llamarl_join_weight_group",
                                args=(specs, metas_json, bucket_mb, solo_mb))

    def receive_weights(self) -> None:
        """Blocking: receive a full set of weights from the trainer and load it."""
        self.post_weights()
        self.load_posted_weights()

    def post_weights(self) -> None:
        """Post the receives of the next weight sync and return: the bytes start moving
        (the caller may do other work, e.g. read the version announced, while they travel)."""
        self.worker.llamarl_post_receives()

    def load_posted_weights(self) -> None:
        """Blocking: finish the sync that post_weights started. The prefix cache (KV computed
        with the old weights) is emptied by the next generate call: not while the bytes
        travel, where its ~0.1 ms of CPU slowed a tiny model's transfer on the 2-core CPU, and
        once for several loads in a row (a generator catching up on versions)."""
        self.worker.llamarl_load_received()
        self._stale_prefix_cache = True

    def checksum(self) -> float:
        return self.llm.collective_rpc("llamarl_state_checksum")[0]
