"""Multi-turn episodes: the policy talks to an environment (rollout.env) that runs its tools.

Token in, token out. An episode's context is a token list that only ever grows: the prompt's
tokens, then each turn's tokens exactly as the engine sampled them (with its EOS), then the
observation's tokens. Sampled text is decoded for the environment to read, never re-encoded
into the context, so the trainer scores exactly the tokens the engine sampled (no
re-tokenisation drift) and the record's loss mask is 1 on them alone:

    [prompt | turn 1 | observation 1 (+ template glue) | turn 2 | ...]
     mask 0    1        0                                 1

Concurrency: every live episode of the call is in flight at once (the runner's loop:
episodes.py). A turn is submitted to the engine as soon as its context is ready and the
engine steps while environment calls (tools) run in the worker processes (env_worker.py), so
an episode waiting for a tool never holds the others. The engine idles only when every live
episode waits for the environment; `engine_busy_s` against `collect_s` says how often.

Limits: rollout.max_turns assistant turns; rollout.max_tokens tokens of context (0 = the
engine's max_model_len): an observation that would leave no room for a turn ends the episode
instead of being appended; a turn gets min(generator.max_new_tokens, what is left). An
episode that hits one ends (finish reason max_turns / context / length) and is still scored.

Randomness: the sampler is seeded per call as for single-turn sampling, but which sequences
share an engine step depends on when tool calls return, so episodes are not bitwise
reproducible when tools take variable time (single-turn runs stay bitwise).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from llamarl.buffer.record import Sample
from llamarl.rollout.context import ContextEncoder
from llamarl.rollout.env_worker import EnvPool
from llamarl.rollout.episode_metrics import episode_metrics, tool_calls_per_episode
from llamarl.rollout.episodes import Episode, EpisodeRunner, episode_row
from llamarl.rollout.source import Collected, RolloutSource

_IDLE_WAIT_S = 0.05  # longest blind wait for the environment while the engine has nothing


@dataclass
class _EnvEpisode(Episode):
    sample: Sample = field(default_factory=Sample)
    last_text: str = ""


class MultiTurnSource(RolloutSource):
    episodic = True  # continuous generation drives its runner()

    @classmethod
    def row_metrics(cls, parts: list[dict]) -> dict:
        """Turns, tool calls, errors, environment time (rollout/episode_metrics.py)."""
        return episode_metrics(parts)

    @classmethod
    def eval_metrics(cls, parts: list[dict], samples: int) -> dict:
        return tool_calls_per_episode(parts, samples)

    def __init__(self, ctx):
        super().__init__(ctx)
        ro = ctx.cfg.rollout
        self.pool = EnvPool(ro.env, ro.tool_format, ro.workers, ro.threads_per_worker,
                            ro.timeout_s)
        self.encoder = ContextEncoder(ctx.tokenizer, ctx.formatter)
        self.max_tokens = ro.max_tokens or ctx.cfg.generator.max_model_len
        self.eos = ctx.tokenizer.eos_token_id
        self.next_episode = 0  # (episodes.EpisodeSource)

    def close(self) -> None:
        self.pool.close()

    def runner(self, temperature: float, spans: bool = False) -> EnvRunner:
        """Episodes driven group by group (continuous generation, generator/continuous.py)."""
        return EnvRunner(self, temperature, spans)

    def collect(self, prompts, n, temperature, seed, version, step=None,
                first=0) -> Collected:
        t_start = time.perf_counter()
        runner = EnvRunner(self, temperature)
        groups = runner.run_episodes(prompts, n, seed, version, first)
        m = runner.metrics
        m["collect_s"] = time.perf_counter() - t_start
        m["generate_s"] = m["collect_s"]  # the step's "generate" phase: episodes, tools included
        return Collected(groups, m)


class EnvRunner(EpisodeRunner):
    """Episodes of rollout.env: an episode opens its environment in a worker ("open": the
    prompt), then alternates an engine turn and an environment call on its text ("turn":
    the observation, or None for a final answer) until it stops or hits a limit, then asks
    for its reward ("reward"). Engine request ids are "<episode>:<turn>"."""

    METRICS = ("episodes", "turns", "tool_calls", "tool_errors", "malformed", "env_errors",
               "env_timeouts", "env_replayed", "env_s", "engine_busy_s")

    def __init__(self, source: MultiTurnSource, temperature: float, spans: bool = False):
        super().__init__(source, temperature, spans)
        self.pool = source.pool
        self._replayed0 = source.pool.replayed  # (env_replayed: counted from here)

    def _open(self, eid: int, key: int, prompt) -> _EnvEpisode:
        self.calls[self.pool.call(eid, "open", episode_row(prompt))] = "open"
        return _EnvEpisode(key)

    def _stop(self, eid: int, ep: _EnvEpisode) -> None:
        # a turn generating, or a call in flight: the turn leaves the engine, the
        # environment is closed
        self.engine.abort([f"{eid}:{ep.sample.turns}"])
        self.calls[self.pool.call(eid, "close", None)] = "close"

    def _end(self, eid: int, finish: str) -> None:
        """No more turns: ask the environment for the reward (the episode ends with it)."""
        ep = self.episodes[eid]
        ep.sample.finish = finish
        self.calls[self.pool.call(eid, "reward", ep.last_text)] = "reward"

    def _submit(self, eid: int) -> None:
        src, ep = self.source, self.episodes[eid]
        room = src.max_tokens - len(ep.sample.token_ids)
        if room <= 0:
            return self._end(eid, "context")
        # a copy: the record's list grows after the turn, the engine keeps what it was given
        self.engine.submit(f"{eid}:{ep.sample.turns}", list(ep.sample.token_ids),
                           self.temperature, min(src.ctx.cfg.generator.max_new_tokens, room))

    def _failed(self, eid: int, method: str, outcome) -> None:
        """A call failed: stop the run (rollout.on_error = stop) or end the episode with
        reward 0."""
        ro, m = self.source.ctx.cfg.rollout, self.metrics
        kind, what = outcome
        m["env_timeouts" if kind == "timeout" else "env_errors"] += 1
        if ro.on_error == "stop":
            what = (f"timed out after {ro.timeout_s:g} s (rollout.timeout_s)"
                    if kind == "timeout" else what)
            raise RuntimeError(f"rollout.env {ro.env!r}: {method} {what}; set "
                               "rollout.on_error=zero to end such episodes with reward 0 "
                               "and go on")
        ep = self.episodes[eid]
        ep.sample.finish = "env_error"
        if not ep.sample.token_ids:  # it never started: its prompt, with nothing to train
            ep.sample.add_context(self.groups[ep.group][0].token_ids)
        self._finish(ep, 0.0)

    def _encode(self, eid: int, method: str, encode, value, *args):
        """encode(value, *args): the token ids of a prompt or observation an environment
        returned, or None when the tokenizer (or chat template) refuses it: then its episode
        fails as a raising call would (the worker already rejects invalid Unicode)."""
        try:
            return encode(value, *args)
        except Exception as e:  # noqa: BLE001 - user text: any error is the episode's
            self._failed(eid, method, ("error", f"{method} returned text the tokenizer cannot "
                                                f"encode ({type(e).__name__}: {e})"))
            self.calls[self.pool.call(eid, "close", None)] = "close"  # (its env)
            return None

    def _on_sampled(self, rid: str, c, version: int) -> None:
        eid = int(rid.split(":")[0])
        ep = self.episodes[eid]
        if self.spans:
            ep.sample.add_completion(c, version)
        else:
            ep.sample.add_sampled(c.token_ids, c.logprobs, version)
        ep.last_text = c.text
        self.metrics["turns"] += 1
        if c.finish_reason != "stop":  # the turn hit its token limit
            full = len(ep.sample.token_ids) >= self.source.max_tokens
            self._end(eid, "context" if full else "length")
        else:
            self.calls[self.pool.call(eid, "turn", c.text)] = "turn"

    def _poll(self, idle: bool) -> list:
        t0 = time.perf_counter()
        results = self.pool.poll(_IDLE_WAIT_S if idle else 0.0)
        self.metrics["env_replayed"] = float(self.pool.replayed - self._replayed0)
        if idle:
            self.metrics["env_s"] += time.perf_counter() - t0
        return results

    def _on_result(self, eid: int, ep: _EnvEpisode, method: str, outcome) -> None:
        src = self.source
        if outcome[0] != "ok":
            return self._failed(eid, method, outcome)
        value = outcome[1]
        if method == "open":
            ids = self._encode(eid, method, src.encoder.prompt_ids, value)
            if ids is not None:
                ep.sample.add_context(ids)
                self._submit(eid)
        elif method == "turn":
            observation, counts = value
            for k, v in counts.items():
                self.metrics[k] += v
            if observation is None:
                self._end(eid, "stop")
            elif ep.sample.turns >= src.ctx.cfg.rollout.max_turns:
                self._end(eid, "max_turns")
            else:
                ended_eos = bool(ep.sample.token_ids) and ep.sample.token_ids[-1] == src.eos
                obs = self._encode(eid, method, src.encoder.observation_ids, observation,
                                   ended_eos)
                if obs is None:
                    return  # (the episode failed)
                if len(ep.sample.token_ids) + len(obs) >= src.max_tokens:
                    self._end(eid, "context")  # no room for the observation and a turn
                else:
                    ep.sample.add_context(obs)
                    self._submit(eid)
        else:  # reward: the episode is complete
            self._finish(ep, float(value))

    def _sample(self, prompt, ep: _EnvEpisode, version: int) -> tuple[Sample, dict]:
        return ep.sample, {}  # (its counts are the environment's, counted per turn)
