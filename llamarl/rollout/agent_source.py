"""rollout.source = agent: episodes of an OpenAI-client agent, served by this engine's gateway.

    agent(client, row) -> reward | {"reward": r, "metrics": {...}}       (rollout.agent)

Each episode runs the user's function in an agent worker (rollout/agent_worker.py) with an
OpenAI client whose base_url is this engine's gateway (gateway/server.py) and whose API key
is the episode's own. Its model calls come back here: AgentRunner.step drains the gateway's
queue, renders each call's prompt (capture.py: spliced onto the episode's earlier
tokens where the history matches), submits it to the engine (Engine.submit, as the
multi-turn EpisodeRunner does), steps the engine, and answers each call when its samples
finish. The engine steps while agents think or run tools; the loop waits (briefly) only
when the engine has nothing to do.

An episode's reward is what the agent returned; its sample, the tokens of its calls as the
engine saw and sampled them (capture.py). An agent that raises, times out
(rollout.agent_timeout_s), crashes its worker or returns a non-number fails its episode
(reward 0, finish reason env_error, counted as agent_errors / agent_timeouts), never the
run, unless every episode of a collection fails: that is a broken agent, and the run
stops with the first error.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

from llamarl.buffer.record import Sample
from llamarl.gateway.requests import error_body
from llamarl.gateway.responses import chat_response, completion_response, tool_parser
from llamarl.gateway.server import Gateway, GatewayCall, resolve
from llamarl.rewards.scorer import ScoredGroup
from llamarl.rollout.agent_worker import AgentPool
from llamarl.rollout.capture import EpisodeCapture, Renderer
from llamarl.rollout.multi_turn import episode_row, run_episodes
from llamarl.rollout.source import Collected, RolloutSource

MODEL_NAME = "policy"  # the model name the gateway serves (GET /v1/models)
_IDLE_WAIT_S = 0.002  # longest wait for a request or a result while the engine is idle


@dataclass
class _Episode:
    group: int
    key: str  # its API key
    capture: EpisodeCapture
    reward: float | None = None
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


class AgentSource(RolloutSource):
    def __init__(self, ctx):
        super().__init__(ctx)
        ro, g = ctx.cfg.rollout, ctx.cfg.generator
        self.parser = tool_parser(ro.tool_parser, ctx.tokenizer)
        self.renderer = Renderer(ctx.tokenizer)
        self.gateway = Gateway(MODEL_NAME, g.temperature, ro.gateway_host, ro.gateway_port)
        self.gateway.start()
        try:
            self.pool = AgentPool(ro.agent, self.gateway.base_url, ro.workers,
                                  ro.threads_per_worker, ro.agent_timeout_s)
        except BaseException:
            self.gateway.close()
            raise
        self._episode_base = 0

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
        done = run_episodes(runner, self.ctx.engine, prompts, n, seed, version, first)
        m = runner.metrics
        if m["episodes"] and m["agent_errors"] + m["agent_timeouts"] == m["episodes"]:
            raise RuntimeError(f"rollout.agent {self.ctx.cfg.rollout.agent!r}: every episode "
                               f"of the batch failed ({runner.first_error}); fix the agent")
        m["collect_s"] = time.perf_counter() - t_start
        m["generate_s"] = m["collect_s"]
        return Collected([done[first + j] for j in range(len(prompts))], m)


class AgentRunner:
    """Agent episodes in flight: the same interface as multi_turn.EpisodeRunner (add, abort,
    step, groups, live, metrics), so continuous generation can drive it too."""

    _METRICS = ("episodes", "turns", "model_calls", "prefix_breaks", "spliced_calls",
                "dropped_sampled_tokens", "agent_errors", "agent_timeouts", "refused_calls",
                "engine_busy_s", "env_s", "tool_calls", "tool_errors", "malformed",
                "env_errors", "env_timeouts")

    def __init__(self, source: AgentSource, temperature: float, spans: bool = False):
        self.source, self.temperature, self.spans = source, temperature, spans
        self.episodes: dict[int, _Episode] = {}
        self.groups: dict[int, tuple[object, list[int]]] = {}
        self.calls: dict[int, int] = {}  # pool call id -> episode
        self.live = 0
        self.metrics = dict.fromkeys(self._METRICS, 0.0)
        self.first_error = ""
        g = source.ctx.cfg.generator
        self.max_new, self.max_len = g.max_new_tokens, g.max_model_len

    def add(self, key: int, prompt, n: int) -> None:
        src = self.source
        base, src._episode_base = src._episode_base, src._episode_base + n
        eids = list(range(base, base + n))
        self.groups[key] = (prompt, eids)
        for eid in eids:
            api_key = src.gateway.open_episode(eid)
            self.episodes[eid] = _Episode(key, api_key, EpisodeCapture(src.renderer))
            self.calls[src.pool.run(eid, episode_row(prompt), api_key)] = eid
        self.live += n

    def abort(self, key: int) -> None:
        """Stop group `key`: its calls leave the engine and are answered 503, its keys are
        revoked; its agents' results are ignored."""
        _, eids = self.groups.pop(key)
        for eid in eids:
            ep = self.episodes.pop(eid)
            if ep.reward is None:
                self.live -= 1
                self._stop_calls(eid, ep, 503, "the episode was stopped")

    def _stop_calls(self, eid: int, ep: _Episode, status: int, why: str) -> None:
        self.source.gateway.close_episode(ep.key)
        engine = self.source.ctx.engine
        for number, p in ep.running.items():
            engine.abort([f"{eid}:{number}:{i}" for i in range(p.call.request.sampling.n)])
            resolve(p.call, status, error_body(why, "server_error"))
        ep.running.clear()

    # -- gateway calls ---------------------------------------------------------------------
    def _take(self, call: GatewayCall) -> None:
        ep = self.episodes.get(call.episode)
        if ep is None or ep.reward is not None:
            self.metrics["refused_calls"] += 1
            return resolve(call, 403, error_body("this episode has ended", "permission_error",
                                                 code="episode_ended"))
        req = call.request
        try:
            if call.kind == "chat":
                ids = ep.capture.chat_prompt(req.messages, req.tools)
            else:
                ids = ep.capture.text_prompt(req.prompt)
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
                "messages" if call.kind == "chat" else "prompt", "context_length_exceeded"))
        max_tokens = min(req.sampling.max_tokens or self.max_new, self.max_new, room)
        number, ep.calls = ep.calls, ep.calls + 1
        ep.running[number] = _Pending(call, ids, [None] * req.sampling.n)
        engine = self.source.ctx.engine
        for i in range(req.sampling.n):
            engine.submit(f"{call.episode}:{number}:{i}", ids, self.temperature, max_tokens,
                          req.sampling.stop or None)

    def _answer(self, eid: int, ep: _Episode, number: int) -> None:
        src = self.source
        p = ep.running.pop(number)
        req, tok = p.call.request, src.ctx.tokenizer
        if not self.spans:
            for c in p.done:
                c.versions = None  # every token by the version of this collection
        if p.call.kind == "chat":
            body, replies = chat_response(req, p.prompt_ids, p.done, src.parser, tok,
                                          MODEL_NAME)
            ep.capture.record(p.prompt_ids, p.done, replies, messages=req.messages,
                              tools=req.tools)
        else:
            body, replies = completion_response(req, p.prompt_ids, p.done, tok, MODEL_NAME)
            ep.capture.record(p.prompt_ids, p.done, replies,
                              prompt_text=req.prompt if isinstance(req.prompt, str) else None)
        self.metrics["turns"] += 1
        c = p.done[0]
        ep.finish = "stop" if c.finish_reason == "stop" else "length"
        resolve(p.call, 200, body)

    # -- the loop --------------------------------------------------------------------------
    def step(self, version: int) -> list[ScoredGroup]:
        src, m = self.source, self.metrics
        engine, gateway = src.ctx.engine, src.gateway
        took = False
        while True:  # the calls that arrived
            try:
                call = gateway.calls.get_nowait()
            except queue.Empty:
                break
            self._take(call)
            took = True
        if engine.busy:
            t0 = time.perf_counter()
            finished = engine.step()
            m["engine_busy_s"] += time.perf_counter() - t0
            for rid, c in finished:
                eid_s, number_s, i_s = rid.split(":")
                ep = self.episodes.get(int(eid_s))
                p = ep.running.get(int(number_s)) if ep is not None else None
                if p is None:
                    continue
                p.done[int(i_s)] = c
                if all(d is not None for d in p.done):
                    self._answer(int(eid_s), ep, int(number_s))
        t0 = time.perf_counter()
        results = src.pool.poll(0.0)
        if not results and not took and not engine.busy:
            try:  # idle: wait for a request (results are polled again right after)
                self._take(gateway.calls.get(timeout=_IDLE_WAIT_S))
            except queue.Empty:
                pass
            m["env_s"] += time.perf_counter() - t0
        ended = set()
        for call_id, eid, outcome in results:
            self.calls.pop(call_id, None)
            ep = self.episodes.get(eid)
            if ep is None or ep.reward is not None:
                continue
            self.live -= 1
            ended.add(ep.group)
            if outcome[0] == "ok":
                ep.reward, ep.metrics = outcome[1]
                self._stop_calls(eid, ep, 403, "the episode has ended")
                continue
            kind, what = outcome
            if kind == "timeout":
                m["agent_timeouts"] += 1
                what = (f"timed out after {src.ctx.cfg.rollout.agent_timeout_s:g} s "
                        "(rollout.agent_timeout_s)")
            else:
                m["agent_errors"] += 1
            self.first_error = self.first_error or what
            ep.reward, ep.finish = 0.0, "env_error"
            self._stop_calls(eid, ep, 403, f"the episode failed: {what}")
        return self._complete(ended, version)

    def _complete(self, ended: set, version: int) -> list[ScoredGroup]:
        m, done = self.metrics, []
        for key in sorted(ended):
            prompt, eids = self.groups[key]
            eps = [self.episodes[e] for e in eids]
            if any(e.reward is None for e in eps):
                continue
            del self.groups[key]
            # counted as they complete, with their model calls and the agent's metrics
            # (capture counts below), and kept with the group: in continuous generation a
            # batch's window also starts episodes that finish in a later one (counted at
            # their start: 0.6 model calls per episode), and a batch may take groups
            # completed in an earlier window (a window's counts could read below 1), so
            # continuous.py sums the batch's own groups' counts
            m["episodes"] += len(eps)
            samples, group_counts = [], {}
            for eid, ep in zip(eids, eps):
                del self.episodes[eid]
                sample, counts = ep.capture.sample(version)
                counts.update({f"agent_{k}": v for k, v in ep.metrics.items()})
                for k, v in counts.items():
                    m[k] = m.get(k, 0.0) + v
                    group_counts[k] = group_counts.get(k, 0.0) + v
                if not sample.token_ids:  # no model call: its prompt, with nothing to train
                    sample = Sample()
                    sample.add_context(prompt.token_ids)
                sample.finish = ep.finish
                samples.append(sample)
            done.append(ScoredGroup(prompt, [], [e.reward for e in eps], {}, key, samples,
                                    group_counts))
        return done

