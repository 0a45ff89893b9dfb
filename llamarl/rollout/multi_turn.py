"""Multi-turn episodes: the policy talks to an environment (rollout.env) that runs its tools.

Token in, token out. An episode's context is a token list that only ever grows: the prompt's
tokens, then each turn's tokens exactly as the engine sampled them (with its EOS), then the
observation's tokens. Sampled text is decoded for the environment to read, never re-encoded
into the context, so the trainer scores exactly the tokens the engine sampled (no
re-tokenisation drift) and the record's loss mask is 1 on them alone:

    [prompt | turn 1 | observation 1 (+ template glue) | turn 2 | ...]
     mask 0    1        0                                 1

Concurrency: every live episode of the call is in flight at once. A turn is submitted to the
engine as soon as its context is ready and the engine steps while environment calls (tools)
run in the worker processes, so an episode waiting for a tool never holds the others. The
engine idles only when every live episode waits for the environment; `engine_busy_s` against
`collect_s` says how often.

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
from llamarl.rewards.scorer import ScoredGroup
from llamarl.rollout.context import ContextEncoder
from llamarl.rollout.env_worker import EnvPool
from llamarl.rollout.source import Collected, RolloutSource

_IDLE_WAIT_S = 0.05  # longest blind wait for the environment while the engine has nothing


@dataclass
class _Episode:
    group: int
    sample: Sample = field(default_factory=Sample)
    reward: float | None = None
    last_text: str = ""


def episode_row(prompt) -> dict:
    """What an environment is built from: the dataset row, with "prompt" and "answer" set to
    the fields data.prompt_field / data.answer_field name (GSM8K's "question" is "prompt")."""
    return {**(prompt.row or {}), "prompt": prompt.text, "answer": prompt.answer}


class MultiTurnSource(RolloutSource):
    def __init__(self, ctx):
        super().__init__(ctx)
        ro = ctx.cfg.rollout
        self.pool = EnvPool(ro.env, ro.tool_format, ro.workers, ro.threads_per_worker,
                            ro.timeout_s)
        self.encoder = ContextEncoder(ctx.tokenizer, ctx.formatter)
        self.max_tokens = ro.max_tokens or ctx.cfg.generator.max_model_len
        self.eos = ctx.tokenizer.eos_token_id
        self._episode_base = 0  # episode ids stay unique across calls (worker-side state)

    def close(self) -> None:
        self.pool.close()

    def runner(self, temperature: float, spans: bool = False) -> EpisodeRunner:
        """Episodes driven group by group (continuous generation, generator/continuous.py)."""
        return EpisodeRunner(self, temperature, spans)

    def collect(self, prompts, n, temperature, seed, version, step=None,
                first=0) -> Collected:
        t_start = time.perf_counter()
        runner = EpisodeRunner(self, temperature)
        done = run_episodes(runner, self.ctx.engine, prompts, n, seed, version, first)
        m = runner.metrics
        m["collect_s"] = time.perf_counter() - t_start
        m["generate_s"] = m["collect_s"]  # the step's "generate" phase: episodes, tools included
        return Collected([done[first + j] for j in range(len(prompts))], m)


def run_episodes(runner, engine, prompts, n: int, seed: int, version: int,
                 first: int) -> dict:
    """A batch call's episodes: seed the engine, add every prompt's group of n (keys first,
    first + 1, ...) and step the runner until none is left; the ScoredGroups by key."""
    engine.begin(seed)
    for j, prompt in enumerate(prompts):
        runner.add(first + j, prompt, n)
    done = {}
    while runner.groups:
        done.update((grp.index, grp) for grp in runner.step(version))
    return done


class EpisodeRunner:
    """Episodes in flight on the engine and in the environment workers. add() opens a prompt
    group's n episodes; step() steps the engine once (when it has work), handles what the
    environment returned, and returns the groups whose episodes have all ended, as
    ScoredGroups (index = the key they were added with). A batch call (MultiTurnSource.collect)
    adds its groups and steps until none is left; continuous generation
    (generator/continuous.py) keeps adding as groups end. `spans`: record per turn the
    versions that sampled its tokens (weights may load mid-turn), else the version given to
    step()."""

    _METRICS = ("episodes", "turns", "tool_calls", "tool_errors", "malformed", "env_errors",
                "env_timeouts", "env_replayed", "env_s", "engine_busy_s")

    def __init__(self, source: MultiTurnSource, temperature: float, spans: bool = False):
        self.source, self.temperature, self.spans = source, temperature, spans
        self.episodes: dict[int, _Episode] = {}
        self.groups: dict[int, tuple[object, list[int]]] = {}  # key -> (prompt, episode ids)
        self.calls: dict[int, str] = {}  # call id -> method
        self.live = 0  # episodes not ended
        self.metrics = dict.fromkeys(self._METRICS, 0.0)
        self._replayed0 = source.pool.replayed  # (env_replayed: counted from here)

    def add(self, key: int, prompt, n: int) -> None:
        src = self.source
        base, src._episode_base = src._episode_base, src._episode_base + n
        eids = list(range(base, base + n))
        self.groups[key] = (prompt, eids)
        for eid in eids:  # episode ids stay unique across calls (worker-side state)
            self.episodes[eid] = _Episode(key)
            self.calls[src.pool.call(eid, "open", episode_row(prompt))] = "open"
        self.live += n
        self.metrics["episodes"] += n

    def abort(self, key: int) -> None:
        """Stop group `key` (not complete): its turns generating leave the engine, its
        environments are closed, and results still to come for it are ignored (step())."""
        _, eids = self.groups.pop(key)
        engine, pool = self.source.ctx.engine, self.source.pool
        for eid in eids:
            ep = self.episodes.pop(eid)
            if ep.reward is None:  # not ended: a turn generating, or a call in flight
                self.live -= 1
                engine.abort([f"{eid}:{ep.sample.turns}"])
                self.calls[pool.call(eid, "close", None)] = "close"

    def _end(self, eid: int, finish: str) -> None:
        ep = self.episodes[eid]
        ep.sample.finish = finish
        self.calls[self.source.pool.call(eid, "reward", ep.last_text)] = "reward"

    def _submit(self, eid: int) -> None:
        src, ep = self.source, self.episodes[eid]
        room = src.max_tokens - len(ep.sample.token_ids)
        if room <= 0:
            return self._end(eid, "context")
        # a copy: the record's list grows after the turn, the engine keeps what it was given
        src.ctx.engine.submit(f"{eid}:{ep.sample.turns}", list(ep.sample.token_ids),
                              self.temperature,
                              min(src.ctx.cfg.generator.max_new_tokens, room))

    def _failed(self, eid: int, method: str, outcome) -> None:
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
        ep.sample.finish, ep.reward = "env_error", 0.0
        if not ep.sample.token_ids:  # it never started: its prompt, with nothing to train
            ep.sample.add_context(self.groups[ep.group][0].token_ids)

    def _encode(self, eid: int, method: str, encode, value, ended: set, *args):
        """encode(value, *args): the token ids of a prompt or observation an environment
        returned, or None when the tokenizer (or chat template) refuses it: then its episode
        fails as a raising call would (the worker already rejects invalid Unicode)."""
        try:
            return encode(value, *args)
        except Exception as e:  # noqa: BLE001 - user text: any error is the episode's
            self._failed(eid, method, ("error", f"{method} returned text the tokenizer cannot "
                                                f"encode ({type(e).__name__}: {e})"))
            self.calls[self.source.pool.call(eid, "close", None)] = "close"  # (its env)
            self.live -= 1
            ended.add(self.episodes[eid].group)
            return None

    def step(self, version: int) -> list[ScoredGroup]:
        src, m = self.source, self.metrics
        engine, pool, ro = src.ctx.engine, src.pool, src.ctx.cfg.rollout
        if engine.busy:
            t0 = time.perf_counter()
            finished = engine.step()
            m["engine_busy_s"] += time.perf_counter() - t0
            for rid, c in finished:
                eid = int(rid.split(":")[0])
                ep = self.episodes[eid]
                if self.spans:
                    ep.sample.add_completion(c, version)
                else:
                    ep.sample.add_sampled(c.token_ids, c.logprobs, version)
                ep.last_text = c.text
                m["turns"] += 1
                if c.finish_reason != "stop":  # the turn hit its token limit
                    full = len(ep.sample.token_ids) >= src.max_tokens
                    self._end(eid, "context" if full else "length")
                else:
                    self.calls[pool.call(eid, "turn", c.text)] = "turn"
        t0 = time.perf_counter()
        results = pool.poll(0.0 if engine.busy else _IDLE_WAIT_S)
        m["env_replayed"] = float(pool.replayed - self._replayed0)
        if not engine.busy:
            m["env_s"] += time.perf_counter() - t0
        ended = set()
        for call_id, eid, outcome in results:
            method = self.calls.pop(call_id)
            ep = self.episodes.get(eid)
            if ep is None or ep.reward is not None:
                continue  # the episode already ended (an error)
            if outcome[0] != "ok":
                self._failed(eid, method, outcome)
                self.live -= 1
                ended.add(ep.group)
                continue
            value = outcome[1]
            if method == "open":
                ids = self._encode(eid, method, src.encoder.prompt_ids, value, ended)
                if ids is None:
                    continue
                ep.sample.add_context(ids)
                self._submit(eid)
            elif method == "turn":
                observation, counts = value
                for k, v in counts.items():
                    m[k] += v
                if observation is None:
                    self._end(eid, "stop")
                elif ep.sample.turns >= ro.max_turns:
                    self._end(eid, "max_turns")
                else:
                    ended_eos = bool(ep.sample.token_ids) and \
                        ep.sample.token_ids[-1] == src.eos
                    obs = self._encode(eid, method, src.encoder.observation_ids,
                                       observation, ended, ended_eos)
                    if obs is None:
                        continue
                    if len(ep.sample.token_ids) + len(obs) >= src.max_tokens:
                        self._end(eid, "context")  # no room for the observation and a turn
                    else:
                        ep.sample.add_context(obs)
                        self._submit(eid)
            else:  # reward: the episode is complete
                ep.reward = float(value)
                self.live -= 1
                ended.add(ep.group)
        done = []
        for key in sorted(ended):
            prompt, eids = self.groups[key]
            eps = [self.episodes[e] for e in eids]
            if any(e.reward is None for e in eps):
                continue
            del self.groups[key]
            for e in eids:
                del self.episodes[e]
            done.append(ScoredGroup(prompt, [], [e.reward for e in eps], {}, key,
                                    [e.sample for e in eps]))
        return done
