"""The service's sampling: a vLLM engine in this process with multi-LoRA (docs/service.md).

Each sampling client is bound to a saved sampler adapter (PEFT's files, written by
save_weights_for_sampler) or to the base. Every request names its adapter in a `LoRARequest`
(an id per adapter directory, so vLLM routes each request to its own adapter and keeps up
to `max_loras` of them resident, the least recently used evicted); the base weights are
vLLM's own copy, never sent. A saved adapter reaches the engine as its adapter tensors,
read from its directory, never as merged weights.

With `merge` (service.sampling_lora: merged, the default on a CPU, where vLLM's LoRA layers
sample 7-9x slower than the base), a request's adapter is merged into the engine's weights
instead (service/merged_lora.py): requests are run in groups by adapter, the engine's weights
switched between groups, one load of the adapted modules each switch.

Sampled logprobs are vLLM's processed logprobs: log softmax(logits / temperature) of the
sampled token, the distribution it was drawn from (what `importance_sampling` and the other
RL losses want as q). `prompt_logprobs` (and compute_logprobs): the logprob of each prompt
token given those before it, the first one None (NaN on the wire).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path

from llamarl.service.merged_lora import BaseWeights, adapter_deltas, adapter_key, merged_weights

DEFAULT_MAX_TOKENS = 16  # a request without max_tokens (the SDK omits None)


class Sampler:
    """vLLM on `model_dir` (tp 1, this process) for adapters up to `max_lora_rank`, at most
    `max_loras` resident, sequences of at most `max_model_len` tokens."""

    def __init__(self, model_dir: str, dtype: str, max_model_len: int, max_loras: int,
                 max_lora_rank: int, kv_cache_bytes: int, seed: int, merge: bool):
        import torch

        from llamarl.generator.cpu_fixes import disable_onednn_prepack, eager_logprob_ranks
        from llamarl.generator.engine import (
            WORKER_EXTENSION,
            file_store_removed,
            prepare_environment,
            warn_if_other_vllm,
        )
        from llamarl.generator.log_hygiene import quiet_third_party
        from llamarl.generator.lora_adapter import engine_lora_args

        on_cpu = not torch.cuda.is_available()
        prepare_environment(None, on_cpu)
        quiet_third_party()  # (vLLM's repeated warnings once each)
        if on_cpu:
            disable_onednn_prepack()
            eager_logprob_ranks()
        from vllm import LLM

        warn_if_other_vllm()
        memory = ({"kv_cache_memory_bytes": kv_cache_bytes} if on_cpu
                  else {"gpu_memory_utilization": 0.3})
        self.max_model_len, self.max_lora_rank = max_model_len, max_lora_rank
        with file_store_removed():
            # (merged: no LoRA layers, a base engine)
            lora = {} if merge else engine_lora_args(max_lora_rank, max_loras)
            self.llm = LLM(model=model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
                           enforce_eager=True, worker_extension_cls=WORKER_EXTENSION,
                           logprobs_mode="processed_logprobs", **lora, **memory)
        self.vocab = self.llm.llm_engine.model_config.get_vocab_size()
        self.on_cpu = on_cpu
        self.worker = self.llm.collective_rpc("llamarl_worker")[0]  # (in this process)
        self._calls = 0
        self._ids: dict[tuple, int] = {}  # adapter (merged_lora.adapter_key) -> its LoRA id
        self._lock = threading.Lock()
        self.merge = merge
        self._base = BaseWeights(model_dir) if merge else None
        self._resident: tuple | None = None  # the adapter merged into the engine's weights
        self._changed: set[str] = set()  # the weights that differ from the base now

    def close(self) -> None:
        """Shut the engine down now. vLLM's in-process engine otherwise shuts down when the
        garbage collector gets to it, and its shutdown tears down vLLM's process-wide
        parallel groups: an engine made since in this process (a restarted service, the next
        test) then fails every call with "pipeline model parallel group is not
        initialized". Idempotent (vLLM detaches its finalizer on the first call)."""
        with self._lock:
            self.llm.llm_engine.engine_core.shutdown()

    def _lora(self, adapter: Path | None):
        """vLLM's request for `adapter`: a new id whenever its contents change (a name saved
        again), so vLLM never serves the adapter it cached before."""
        from vllm.lora.request import LoRARequest

        key = adapter_key(adapter)
        if key is None:
            return None
        if key not in self._ids:
            self._ids[key] = len(self._ids) + 1
        return LoRARequest(f"adapter{self._ids[key]}", self._ids[key], key[0])

    def _merge(self, adapter: Path | None) -> None:
        """Make the engine's weights the base plus `adapter`'s delta (the base: None)."""
        key = adapter_key(adapter)
        if key == self._resident:
            return
        deltas = adapter_deltas(adapter) if adapter is not None else {}
        model = self.worker.model_runner.model
        names = self._changed | set(deltas)
        self._resident, self._changed = None, names  # (what a failed load may have touched)
        model.load_weights(merged_weights(self._base, deltas, names,
                                          self.llm.llm_engine.model_config.dtype))
        self._resident, self._changed = key, set(deltas)

    def sample(self, jobs: list[SampleJob]) -> list[bytes]:
        """The SDK's SampleResponse (protobuf) for each request, all run in one vLLM generate
        call: the requests that arrive while the engine is busy are batched together (each
        with its own sampling parameters and its own adapter), as vLLM batches an engine's
        sequences; one at a time, a request of 8 samples used a small part of what the
        engine decodes in a step."""
        with self._lock:
            if not self.merge:
                outs = self._generate(jobs, [self._lora(j.adapter) for j in jobs])
                return [_response(j, out) for j, out in zip(jobs, outs)]
            by_adapter: dict[Path | None, list[int]] = {}
            for i, job in enumerate(jobs):
                by_adapter.setdefault(job.adapter, []).append(i)
            responses: list[bytes] = [b""] * len(jobs)
            for adapter, indices in by_adapter.items():
                self._merge(adapter)
                group = [jobs[i] for i in indices]
                for i, job, out in zip(indices, group, self._generate(group, None)):
                    responses[i] = _response(job, out)
            return responses

    def _generate(self, jobs: list[SampleJob], loras: list | None) -> list:
        from vllm import TokensPrompt

        if self.on_cpu:
            # vLLM's per-request generators crash on a CPU as soon as it chunks a prefill or
            # preempts a sequence ("CPU Generator does not use offset", docs/generator.md):
            # the call's sampler is seeded instead, with the first request's seed (a lone
            # request is reproducible; batched, its draws also depend on the requests beside
            # it)
            seeds = [j.params["seed"] for j in jobs if j.params.get("seed") is not None]
            self._calls += 1
            self.worker.llamarl_seed_sampler(seeds[0] if seeds else self._calls)
        return self.llm.generate([TokensPrompt(prompt_token_ids=j.prompt) for j in jobs],
                                 [self._params(j) for j in jobs], lora_request=loras,
                                 use_tqdm=False)

    def _params(self, job: SampleJob):
        from vllm import SamplingParams

        params, stop = job.params, job.params.get("stop")
        extra: dict = {}
        if stop == []:
            extra["ignore_eos"] = True  # (the SDK's [] : no stop at all, not even EOS)
        elif isinstance(stop, str):
            extra["stop"] = [stop]
        elif stop and all(isinstance(s, int) for s in stop):
            extra["stop_token_ids"] = list(stop)
        elif stop:
            extra["stop"] = list(stop)
        max_tokens = params.get("max_tokens") or min(DEFAULT_MAX_TOKENS,
                                                     self.max_model_len - len(job.prompt))
        top_k = int(params.get("top_k", -1))
        return SamplingParams(n=job.num_samples, temperature=float(params.get("temperature",
                                                                              1.0)),
                              top_p=float(params.get("top_p", 1.0)),
                              top_k=0 if top_k < 0 else top_k, max_tokens=int(max_tokens),
                              seed=None if self.on_cpu else params.get("seed"), logprobs=0,
                              prompt_logprobs=0 if job.prompt_logprobs else None,
                              detokenize=bool(extra.get("stop")), **extra)


@dataclass
class SampleJob:
    """One asample request: its prompt token ids, samples, the SDK's sampling_params, the
    adapter directory (None: the base) and whether the prompt's logprobs are wanted."""

    prompt: list[int]
    num_samples: int
    params: dict
    adapter: Path | None
    prompt_logprobs: bool


def _response(job: SampleJob, out) -> bytes:
    from llamarl.service.wire import sample_response

    sequences = []
    for c in out.outputs:
        ids = list(c.token_ids)
        lps = [step[t].logprob for step, t in zip(c.logprobs, ids)]
        sequences.append((ids, lps, "length" if c.finish_reason == "length" else "stop"))
    prompt_lp = None
    if job.prompt_logprobs:
        prompt_lp = [math.nan] + [step[t].logprob for step, t in
                                  zip(out.prompt_logprobs[1:], job.prompt[1:])]
    return sample_response(sequences, prompt_lp)


def check_sample(prompt: list[int], num_samples: int, params: dict, vocab: int,
                 max_model_len: int) -> None:
    """A ValueError naming what is wrong with a sample request, before the engine sees it."""
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"the prompt has token ids outside the vocabulary [0, {vocab}): "
                         f"{bad[:5]}")
    if not 1 <= num_samples <= 256:
        raise ValueError(f"num_samples {num_samples}: give 1 to 256")
    max_tokens = params.get("max_tokens")
    room = max_model_len - len(prompt)
    if room < 1 or (max_tokens is not None and not 1 <= max_tokens <= room):
        raise ValueError(f"a prompt of {len(prompt)} tokens and max_tokens {max_tokens}: this "
                         f"server samples at most {max_model_len} tokens in all "
                         "(service.max_tokens)")
    temperature = params.get("temperature", 1.0)
    if not temperature > 0:
        raise ValueError(f"temperature {temperature}: give a value > 0")
    if not 0 < params.get("top_p", 1.0) <= 1:
        raise ValueError(f"top_p {params.get('top_p')}: give a value in (0, 1]")
