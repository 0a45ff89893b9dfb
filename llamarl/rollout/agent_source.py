"""rollout.source = agent: episodes of an OpenAI-client agent, served by this engine's gateway.

    agent(client, row) -> reward | {"reward": r, "metrics": {...}}       (rollout.agent)

Each episode runs the user's function in an agent worker (rollout/agent_worker.py) with an
OpenAI client whose base_url is this engine's gateway (gateway/server.py) and whose API key
is the episode's own. Its model calls come back here: AgentRunner.step drains the gateway's
queue, renders each call's prompt (capture.py: spliced onto the episode's earlier tokens
where the history matches), submits it to the engine (Engine.submit, as the multi-turn
EnvRunner does), steps the engine, and answers each call when its samples finish. The engine
steps while agents think or run tools; the loop (episodes.py, the runner core both share)
waits (briefly) only when the engine has nothing to do.

An episode's reward is what the agent returned; its sample, the tokens of its calls as the
engine saw and sampled them (capture.py). An agent that raises, times out
(rollout.agent_timeout_s), crashes its worker or returns a non-number fails its episode
(reward 0, finish reason env_error, counted as agent_errors / agent_timeouts), never the
run, unless every episode of a collection fails: that is a broken agent, and the run
stops with the first error.
"""

from __future__ import annotations

import queue
import sys
import time
from dataclasses import dataclass, field

from llamarl.buffer.record import Sample
from llamarl.gateway.requests import error_body
from llamarl.gateway.responses import (
    chat_response,
    completion_response,
    forced_call_prefix,
    generate_response,
    tool_parser,
)
from llamarl.gateway.server import Gateway, GatewayCall, resolve
from llamarl.rollout.agent_worker import AgentPool
from llamarl.rollout.capture import EpisodeCapture, Renderer
from llamarl.rollout.episode_metrics import agent_metrics
from llamarl.rollout.episodes import Episode, EpisodeRunner, episode_row
from llamarl.rollout.source import Collected, RolloutSource

MODEL_NAME = "policy"  # the model name the gateway serves (GET /v1/models)
_IDLE_WAIT_S = 0.002  # longest wait for a request or a result while the engine is idle


@dataclass
class _AgentEpisode(Episode):
    key: str  # its API key
    capture: EpisodeCapture
    finish: str = "stop"
    calls: int = 0  # model calls made (request ids)
    running: dict = field(default_factory=dict)  # call number -> _Pending
    metrics: dict = field(default_factory=dict)  # what the agent returned with its reward


@dataclass
class _Pending:
    """A gateway call in the engine: its n samples, filled as they finish."""

    call: GatewayCall
    prompt_ids: list[int]
    done: list = field(default_factory=list)
    prefix: str = ""  # a forced tool call's start at the end of the prompt (tool_choice)


class AgentSource(RolloutSource):
    episodic = True  # continuous generation drives its runner()

    @classmethod
    def row_metrics(cls, parts: list[dict]) -> dict:
        """The episodes' metrics and the agent's (rollout/episode_metrics.py)."""
        return agent_metrics(parts)

    def __init__(self, ctx):
        super().__init__(ctx)
        ro, g = ctx.cfg.rollout, ctx.cfg.generator
        self.parser = tool_parser(ro.tool_parser, ctx.tokenizer)
        self.renderer = Renderer(ctx.tokenizer, ro.tool_parser)
        self.gateway = Gateway(MODEL_NAME, g.temperature, ro.gateway_host, ro.gateway_port)
        self.gateway.start()
        try:
            self.pool = AgentPool(ro.agent, self.gateway.base_url, ro.workers,
                                  ro.threads_per_worker, ro.agent_timeout_s)
        except BaseException:
            self.gateway.close()
            raise
        self.next_episode = 0  # (episodes.EpisodeSource)
        self.said_reasons: set[str] = set()  # 4xx reasons said in the log (count_refusals)

    def close(self) -> None:
        self.pool.close()
        self.gateway.close()

    def runner(self, temperature: float, spans: bool = False) -> AgentRunner:
        """Episodes driven group by group (continuous generation, generator/continuous.py)."""
        return AgentRunner(self, temperature, spans)

    def collect(self, prompts, n, temperature, seed, version, step=None,
                first=0) -> Collected:
        t_start = time.perf_counter()
        runner = AgentRunner(self, temperature)
        groups = runner.run_episodes(prompts, n, seed, version, first)
        runner.count_refusals()  # (those answered since its last look)
        m = runner.metrics
        if m["episodes"] and m["agent_errors"] + m["agent_timeouts"] == m["episodes"]:
            raise RuntimeError(f"rollout.agent {self.ctx.cfg.rollout.agent!r}: every episode "
                               f"of the batch failed ({runner.first_error}); fix the agent")
        m["collect_s"] = time.perf_counter() - t_start
        m["generate_s"] = m["collect_s"]
        return Collected(groups, m)


class AgentRunner(EpisodeRunner):
    """Agent episodes in flight: an episode runs the agent in a worker ("run") with its own
    gateway key; the agent's model calls arrive through the gateway's queue (_intake), each
    is n engine requests "<episode>:<call number>:<choice>", answered when all n finish.
    The episode ends with what the agent returned (its reward), or fails."""

    METRICS = ("episodes", "turns", "model_calls", "prefix_breaks", "spliced_calls",
               "dropped_sampled_tokens", "agent_errors", "agent_timeouts", "refused_calls",
               "unknown_tool_calls",
               "engine_busy_s", "env_s", "tool_calls", "tool_errors", "malformed",
               "env_errors", "env_timeouts")

    def __init__(self, source: AgentSource, temperature: float, spans: bool = False):
        super().__init__(source, temperature, spans)
        self.first_error = ""
        g = source.ctx.cfg.generator
        self.max_new, self.max_len = g.max_new_tokens, g.max_model_len
        self.vocab = len(source.ctx.tokenizer)  # ids at or past it are refused (token prompts)

    def _open(self, eid: int, key: int, prompt) -> _AgentEpisode:
        src = self.source
        api_key = src.gateway.open_episode(eid)
        self.calls[src.pool.run(eid, episode_row(prompt), api_key)] = "run"
        return _AgentEpisode(key, api_key, EpisodeCapture(src.renderer))

    def _stop(self, eid: int, ep: _AgentEpisode) -> None:
        # its calls leave the engine and are answered 503, its key is revoked; its agent's
        # result is ignored when it comes
        self._stop_calls(eid, ep, 503, "the episode was stopped")

    def _stop_calls(self, eid: int, ep: _AgentEpisode, status: int, why: str) -> None:
        self.source.gateway.close_episode(ep.key)
        for number, p in ep.running.items():
            self.engine.abort([f"{eid}:{number}:{i}" for i in range(p.call.request.sampling.n)])
            resolve(p.call, status, error_body(why, "server_error"))
        ep.running.clear()

    # -- gateway calls ---------------------------------------------------------------------
    def _intake(self) -> bool:
        self.count_refusals()
        took = False
        while True:  # the calls that arrived
            try:
                call = self.source.gateway.calls.get_nowait()
            except queue.Empty:
                return took
            self._take(call)
            took = True

    def count_refusals(self) -> None:
        """The gateway's 4xx answers since the last look, as gateway_4xx/<reason> counts
        (episode_metrics.agent_metrics: the row's gateway_4xx and its most common reason); a
        reason's first answer is said once per process, with its message."""
        gateway = self.source.gateway
        for reason, n in gateway.take_refusals().items():
            key = f"gateway_4xx/{reason}"
            self.metrics[key] = self.metrics.get(key, 0.0) + n
            if reason not in self.source.said_reasons:
                self.source.said_reasons.add(reason)
                print(f"llamarl: generator {self.source.ctx.engine_index}: the gateway "
                      f"answered {reason}: {gateway.reason_messages.get(reason, '')[:300]} "
                      "(counted in metrics.jsonl: gateway_4xx)", file=sys.stderr, flush=True)

    def _take(self, call: GatewayCall) -> None:
        ep = self.episodes.get(call.episode)
        if ep is None or ep.reward is not None:
            self.metrics["refused_calls"] += 1
            return resolve(call, 403, error_body("this episode has ended", "permission_error",
                                                 code="episode_ended"))
        req = call.request
        given = req.token_ids if call.kind == "generate" else getattr(req, "prompt", None)
        if isinstance(given, list) and (bad := next((t for t in given if t >= self.vocab),
                                                    None)) is not None:
            self.metrics["refused_calls"] += 1
            return resolve(call, 400, error_body(
                f"token id {bad} is not in the model's vocabulary ({self.vocab} tokens)",
                "invalid_request_error", "token_ids" if call.kind == "generate" else "prompt",
                "invalid_value"))
        prefix = ""
        if call.kind == "chat":
            try:
                prefix = forced_call_prefix(self.source.ctx.cfg.rollout.tool_parser,
                                            req.tool_choice, req.forced)
            except ValueError as e:
                self.metrics["refused_calls"] += 1
                return resolve(call, 400, error_body(str(e), "invalid_request_error",
                                                     "tool_choice", "invalid_value"))
        try:
            if call.kind == "chat":
                ids = ep.capture.chat_prompt(req.messages, req.tools)
                if prefix:  # the forced call's start, as context (responses.py)
                    ids = ids + self.source.ctx.tokenizer(
                        prefix, add_special_tokens=False)["input_ids"]
            else:  # completion text or ids; generate: ids as given (spliced, token-exact)
                ids = ep.capture.text_prompt(given if call.kind == "generate" else req.prompt)
        except Exception as e:  # noqa: BLE001 - a template or tokenizer refusing the input
            self.metrics["refused_calls"] += 1
            return resolve(call, 400, error_body(
                f"the prompt cannot be rendered: {type(e).__name__}: {e}",
                "invalid_request_error", code="invalid_prompt"))
        room = self.max_len - len(ids)
        if room <= 0:
            self.metrics["refused_calls"] += 1
            return resolve(call, 400, error_body(
                f"the prompt is {len(ids)} tokens; this engine's context is "
                f"{self.max_len} (generator.max_model_len)", "invalid_request_error",
                {"chat": "messages", "generate": "token_ids"}.get(call.kind, "prompt"),
                "context_length_exceeded"))
        max_tokens = min(req.sampling.max_tokens or self.max_new, self.max_new, room)
        number, ep.calls = ep.calls, ep.calls + 1
        ep.running[number] = _Pending(call, ids, [None] * req.sampling.n, prefix)
        for i in range(req.sampling.n):
            self.engine.submit(f"{call.episode}:{number}:{i}", ids, self.temperature,
                               max_tokens, req.sampling.stop or None)

    def _on_sampled(self, rid: str, c, version: int) -> None:
        eid_s, number_s, i_s = rid.split(":")
        ep = self.episodes.get(int(eid_s))
        p = ep.running.get(int(number_s)) if ep is not None else None
        if p is None:
            return
        p.done[int(i_s)] = c
        if all(d is not None for d in p.done):
            self._answer(ep, int(number_s), version)

    def _answer(self, ep: _AgentEpisode, number: int, version: int) -> None:
        src = self.source
        p = ep.running.pop(number)
        req, tok = p.call.request, src.ctx.tokenizer
        if not self.spans:
            for c in p.done:
                c.versions = None  # every token by the version of this collection
        if p.call.kind == "chat":
            body, replies, unknown = chat_response(req, p.prompt_ids, p.done, src.parser,
                                                   tok, MODEL_NAME, p.prefix)
            self.metrics["unknown_tool_calls"] += unknown
            ep.capture.record(p.prompt_ids, p.done, replies, messages=req.messages,
                              tools=req.tools)
        elif p.call.kind == "generate":
            body = generate_response(req, p.prompt_ids, p.done, tok, MODEL_NAME, version)
            ep.capture.record(p.prompt_ids, p.done, [None] * len(p.done))
        else:
            body, replies = completion_response(req, p.prompt_ids, p.done, tok, MODEL_NAME)
            ep.capture.record(p.prompt_ids, p.done, replies,
                              prompt_text=req.prompt if isinstance(req.prompt, str) else None)
        self.metrics["turns"] += 1
        c = p.done[0]
        ep.finish = "stop" if c.finish_reason == "stop" else "length"
        resolve(p.call, 200, body)

    # -- agent results ---------------------------------------------------------------------
    def _poll(self, idle: bool) -> list:
        t0 = time.perf_counter()
        results = self.source.pool.poll(0.0)
        if not results and idle:
            try:  # idle: wait for a request (results are polled again right after)
                self._take(self.source.gateway.calls.get(timeout=_IDLE_WAIT_S))
            except queue.Empty:
                pass
            self.metrics["env_s"] += time.perf_counter() - t0
        return results

    def _on_result(self, eid: int, ep: _AgentEpisode, method: str, outcome) -> None:
        if outcome[0] == "ok":
            reward, ep.metrics = outcome[1]
            self._finish(ep, reward)
            return self._stop_calls(eid, ep, 403, "the episode has ended")
        kind, what = outcome
        if kind == "timeout":
            self.metrics["agent_timeouts"] += 1
            what = (f"timed out after {self.source.ctx.cfg.rollout.agent_timeout_s:g} s "
                    "(rollout.agent_timeout_s)")
        else:
            self.metrics["agent_errors"] += 1
        self.first_error = self.first_error or what
        ep.finish = "env_error"
        self._finish(ep, 0.0)
        self._stop_calls(eid, ep, 403, f"the episode failed: {what}")

    def _sample(self, prompt, ep: _AgentEpisode, version: int) -> tuple[Sample, dict]:
        """The capture's sequence, with its counts and the agent's metrics (agent_<name>)."""
        sample, counts = ep.capture.sample(version)
        counts.update({f"agent_{k}": v for k, v in ep.metrics.items()})
        if not sample.token_ids:  # no model call: its prompt, with nothing to train
            sample = Sample()
            sample.add_context(prompt.token_ids)
        sample.finish = ep.finish
        return sample, counts
