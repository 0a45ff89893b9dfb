"""The episode-runner core: prompt groups of episodes in flight on the engine, stepped by one
loop. Its two uses: episodes of an Environment in worker processes (multi_turn.EnvRunner) and
episodes of an OpenAI-client agent served by the gateway (agent_source.AgentRunner).

An episode is many engine requests (turns, model calls) with outside work between them (a
tool call, an agent thinking). All of a runner's episodes are in flight at once: the engine
steps while the outside work runs, and the runner waits (briefly) only when the engine has
nothing to do. Two drivers step a runner: run_episodes() for a batch call (the source's
collect()), and continuous generation (generator/continuous.py: EpisodePool), which keeps
adding groups as others complete and may abort a group whose slot was handed back.

    runner.add(key, prompt, n)       open n episodes of `prompt` as group `key`
    runner.step(version)             one engine step (when it has work) and the outside
                                     work that ended; the groups that completed
    runner.abort(key)                stop a group that has not completed
    runner.groups, .live, .metrics   the groups not returned yet, the episodes not ended,
                                     the counts so far
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol

from llamarl.buffer.record import Sample
from llamarl.rewards.scorer import ScoredGroup
from llamarl.rollout.source import SourceContext


class EpisodeSource(Protocol):
    """What a runner uses of its source: the context (engine, tokenizer, recipe) and the next
    episode id. Ids are drawn from the source, not the runner, so they stay unique across the
    runners of one source (a batch call makes a runner per call): its workers keep state per
    episode id."""

    ctx: SourceContext
    next_episode: int


@dataclass
class Episode:
    """One episode's state. `group`: the key it was added with; `reward`: None until it
    ends (then nothing of it is in the engine, and results still to come for it, such as
    an environment's close, are dropped)."""

    group: int
    reward: float | None = field(default=None, kw_only=True)


def episode_row(prompt) -> dict:
    """What an episode is built from (an environment, or the row an agent is given): the
    dataset row, with "prompt" and "answer" set to the fields data.prompt_field /
    data.answer_field name (GSM8K's "question" is "prompt")."""
    return {**(prompt.row or {}), "prompt": prompt.text, "answer": prompt.answer}


class EpisodeRunner(ABC):
    """Groups of episodes on the engine; add() opens a group, step() advances every episode
    and returns the groups whose episodes have all ended, as ScoredGroups.

    Ordering: a group is returned by the step() in which its last episode ends, once; the
    groups of one step in order of their keys. A ScoredGroup's `index` is its key, its
    rewards and samples are in episode order (episode ids are consecutive within a group, in
    order of add()), and its `counts` are its episodes' own counts (_sample) summed.

    Ownership: the runner owns its episode table (`episodes`, `groups`) and the calls it
    made to the source's worker pool (`calls`: call id -> method). A group's episodes are
    freed when it is returned, or when it is aborted: abort() hands each episode not ended
    to the use (_stop), which takes its requests out of the engine and releases what it
    holds outside (the environment, the agent's gateway key); results that arrive later for
    a freed episode, or for a call of an earlier runner of the source, are dropped. The
    runner never closes the source's pools or gateway: the source does (close()).

    Engine: a use submits and aborts its own requests on `source.ctx.engine`; request ids
    begin with "<episode id>:". The runner steps the engine only when it is busy, and never
    seeds it: run_episodes() does for a batch call, the continuous loop for itself.

    A use implements _open (start an episode), _on_sampled (a finished engine request),
    _on_result (a result of the worker pool), _poll (collect those results, waiting when
    idle), _stop (abort an episode) and _sample (an ended episode's trained record); it may
    implement _intake (outside work to submit before the engine steps). An episode ends
    through _finish, which counts it out of `live` and lets its group complete.

    `spans`: record per turn the versions that sampled its tokens (continuous generation:
    weights may load mid-turn), else the version given to step()."""

    # the counts in `metrics`; a use's tuple lists its own too, and must have these four
    METRICS = ("episodes", "turns", "env_s", "engine_busy_s")

    def __init__(self, source: EpisodeSource, temperature: float, spans: bool = False):
        self.source, self.temperature, self.spans = source, temperature, spans
        self.engine = source.ctx.engine
        self.episodes: dict[int, Episode] = {}
        self.groups: dict[int, tuple[object, list[int]]] = {}  # key -> (prompt, episode ids)
        self.calls: dict[int, str] = {}  # worker-pool call id -> method
        self.live = 0  # episodes not ended
        self.metrics = dict.fromkeys(self.METRICS, 0.0)
        self._ended: set[int] = set()  # keys of groups an episode of ended in this step

    # -- the driver's interface --------------------------------------------------------------
    def add(self, key: int, prompt, n: int) -> None:
        """Open group `key`: `n` episodes of `prompt` (data.prompts.Prompt)."""
        src = self.source
        first, src.next_episode = src.next_episode, src.next_episode + n
        eids = list(range(first, first + n))
        self.groups[key] = (prompt, eids)
        for eid in eids:
            self.episodes[eid] = self._open(eid, key, prompt)
        self.live += n

    def abort(self, key: int) -> None:
        """Stop group `key` (not returned yet): its episodes are freed, those not ended
        stopped (_stop); nothing of it is returned."""
        _, eids = self.groups.pop(key)
        for eid in eids:
            ep = self.episodes.pop(eid)
            if ep.reward is None:
                self.live -= 1
                self._stop(eid, ep)

    def step(self, version: int) -> list[ScoredGroup]:
        """Submit the outside work that arrived, step the engine once if it has work (its
        finished requests to _on_sampled), then take the worker pool's results (_on_result);
        the groups that completed. `version`: the policy version of what the engine sampled
        (without spans)."""
        m = self.metrics
        took = self._intake()
        if self.engine.busy:
            t0 = time.perf_counter()
            finished = self.engine.step()
            m["engine_busy_s"] += time.perf_counter() - t0
            for rid, c in finished:
                self._on_sampled(rid, c, version)
        for call_id, eid, outcome in self._poll(idle=not took and not self.engine.busy):
            method = self.calls.pop(call_id, None)
            ep = self.episodes.get(eid)
            if ep is None or ep.reward is not None:
                continue  # the episode was aborted, or already ended (an error)
            self._on_result(eid, ep, method, outcome)
        return self._complete(version)

    def run_episodes(self, prompts: list, n: int, seed: int, version: int,
                     first: int) -> list[ScoredGroup]:
        """A batch call's episodes: seed the engine, add every prompt's group of n (keys
        first, first + 1, ...) and step until none is left; the groups in prompt order."""
        self.engine.begin(seed)
        for j, prompt in enumerate(prompts):
            self.add(first + j, prompt, n)
        done = {}
        while self.groups:
            done.update((grp.index, grp) for grp in self.step(version))
        return [done[first + j] for j in range(len(prompts))]

    # -- for the uses ------------------------------------------------------------------------
    def _finish(self, ep: Episode, reward: float) -> None:
        """End episode `ep` with `reward`: its group completes in this step if it was the
        last. The use has stopped (or is stopping) what it still held."""
        ep.reward = reward
        self.live -= 1
        self._ended.add(ep.group)

    def _complete(self, version: int) -> list[ScoredGroup]:
        done = []
        for key in sorted(self._ended):
            prompt, eids = self.groups[key]
            eps = [self.episodes[e] for e in eids]
            if any(e.reward is None for e in eps):
                continue
            del self.groups[key]
            # counted as they complete, with each episode's own counts (_sample), which are
            # also kept with the group: in continuous generation a batch's window also starts
            # episodes that finish in a later one, and a batch may take groups completed in
            # an earlier window, so continuous.py sums the batch's own groups' counts
            self.metrics["episodes"] += len(eps)
            samples, counts = [], {}
            for eid, ep in zip(eids, eps):
                del self.episodes[eid]
                sample, own = self._sample(prompt, ep, version)
                for k, v in own.items():
                    self.metrics[k] = self.metrics.get(k, 0.0) + v
                    counts[k] = counts.get(k, 0.0) + v
                samples.append(sample)
            done.append(ScoredGroup(prompt, [], [e.reward for e in eps], {}, key, samples,
                                    counts))
        self._ended.clear()
        return done

    # -- what a use implements ---------------------------------------------------------------
    @abstractmethod
    def _open(self, eid: int, key: int, prompt) -> Episode:
        """Start episode `eid` of group `key` (its outside work, e.g. a pool call recorded
        in `calls`); its state."""

    def _intake(self) -> bool:
        """Submit the outside work that arrived since the last step (before the engine steps,
        so it is stepped now); whether any did. Default: none."""
        return False

    @abstractmethod
    def _on_sampled(self, rid: str, completion, version: int) -> None:
        """The engine finished request `rid` (generator.engine.Completion)."""

    @abstractmethod
    def _poll(self, idle: bool) -> list[tuple[int, int, tuple]]:
        """The worker pool's results: (call id, episode id, outcome). `idle`: nothing came in
        and the engine has nothing to do, so this may wait briefly for outside work (counted
        in env_s)."""

    @abstractmethod
    def _on_result(self, eid: int, ep: Episode, method: str | None, outcome: tuple) -> None:
        """A result of call `method` for live episode `eid`: ("ok", value), or ("error" |
        "timeout", why)."""

    @abstractmethod
    def _stop(self, eid: int, ep: Episode) -> None:
        """Episode `eid` (not ended) is aborted: take its requests out of the engine and
        release what it holds outside."""

    @abstractmethod
    def _sample(self, prompt, ep: Episode, version: int) -> tuple[Sample, dict]:
        """Ended episode `ep`'s trained record and its own counts (summed into `metrics` and
        the group's counts)."""
