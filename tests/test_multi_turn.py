"""Multi-turn pieces without an engine: tool-call parsing, the environment worker pool
(concurrency, timeouts, crashes), chat-template glue, the built-in environments."""

from __future__ import annotations

import time

import pytest

from llamarl.envs.calculator import CalculatorEnv, calculate
from llamarl.envs.lookup import LookupEnv
from llamarl.envs.multiply import MultiplyEnv
from llamarl.rollout.env_worker import EnvPool
from llamarl.rollout.tool_calls import parse_turn
from llamarl.tiny import lookup

TOOLS = {"calculate": calculate, "lookup": lambda k: k}


def test_hermes_calls_are_parsed_and_malformed_ones_reported():
    text = ('Let me compute. <tool_call>{"name": "calculate", "arguments": {"expression": '
            '"3*7"}}</tool_call> and <tool_call>{"name": "nope", "arguments": {}}</tool_call>'
            '<tool_call>{bad json}</tool_call><tool_call>{"name": "lookup"')
    p = parse_turn(text, "hermes", TOOLS)
    assert [(c.name, c.kwargs) for c in p.calls] == [("calculate", {"expression": "3*7"})]
    assert len(p.malformed) == 3
    assert "no tool 'nope'" in p.malformed[0] and "not valid JSON" in p.malformed[1]
    assert "not closed" in p.malformed[2]
    assert parse_turn("The answer is 21.\n#### 21", "hermes", TOOLS).is_answer


def test_compact_calls():
    one = {"lookup": lambda k: k}
    assert parse_turn("*a", "compact", one).calls[0].args == ["a"]
    assert parse_turn("*lookup b", "compact", TOOLS).calls[0].args == ["b"]
    assert parse_turn("*", "compact", one).malformed
    assert parse_turn("37", "compact", one).is_answer


def test_calculator_is_arithmetic_only():
    assert calculate("(12 + 7) * 3") == "57" and calculate("7 / 2") == "3.5"
    with pytest.raises(ValueError):
        calculate("__import__('os').system('true')")
    with pytest.raises(ValueError):
        calculate("9 ** 999")


def test_environment_turns_run_tools_and_show_errors():
    env = LookupEnv({"prompt": "ab=", "answer": "37", "table": "370000000000"})
    obs, counts = env.turn("*a", "compact")
    assert obs == "3=" and counts == {"tool_calls": 1, "tool_errors": 0, "malformed": 0}
    obs, counts = env.turn("*z", "compact")  # unknown key: the tool raises
    assert obs == "-=" and counts["tool_errors"] == 1
    assert env.turn("37", "compact")[0] is None
    assert env.reward("37") == 1.0 and env.reward("30") == 0.5 and env.reward("*a") == 0.0
    calc = CalculatorEnv({"prompt": "What is 3*7?", "answer": "21"})
    obs, counts = calc.turn('<tool_call>{"name": "calculate", "arguments": {"expression": '
                            '"3*7"}}</tool_call>', "hermes")
    assert obs == [{"role": "tool", "content": "21"}] and counts["tool_calls"] == 1
    assert calc.reward("so #### 21") == 1.0


def test_the_multiply_task_and_its_agent_run_the_same_calculator():
    """The multiply environment's worked example is a call its own parser runs, its reward
    is the numeric verifier on the final turn, and the agent version turns a reply's
    tool_calls into the same results (or an "error: ..." observation)."""
    from types import SimpleNamespace

    from llamarl.envs.multiply_agent import run_call

    env = MultiplyEnv({"prompt": "What is 237 * 82?", "answer": "19434"})
    first = env.prompt()
    assert [m["role"] for m in first] == ["system", "user", "assistant", "tool", "assistant",
                                          "user"]
    assert first[-1]["content"] == "What is 237 * 82?"
    obs, counts = env.turn(first[2]["content"].replace("214 * 37", "237 * 82"), "hermes")
    assert obs == [{"role": "tool", "content": "19434"}] and counts["tool_calls"] == 1
    assert env.reward("19434") == 1.0 and env.reward("19,434") == 1.0
    assert env.reward("It is 19434, not 19435") == 0.0 and env.reward("") == 0.0

    def call(name, arguments):
        return SimpleNamespace(function=SimpleNamespace(name=name, arguments=arguments))

    assert run_call(call("calculate", '{"expression": "237 * 82"}')) == "19434"
    assert run_call(call("calc", '{"expression": "1"}')).startswith("error: there is no tool")
    assert run_call(call("calculate", '{"expr": "1"}')).startswith("error: calculate raised")
    assert run_call(call("calculate", "not json")).startswith("error: calculate raised")


def _run(pool, calls, deadline_s=30.0):
    ids = {pool.call(ep, method, arg): ep for ep, method, arg in calls}
    out = {}
    t0 = time.monotonic()
    while len(out) < len(ids) and time.monotonic() - t0 < deadline_s:
        for call_id, ep, outcome in pool.poll(0.05):
            out[call_id] = (ep, outcome)
    return [out[i] for i in ids]


def test_env_pool_overlaps_waiting_tools():
    pool = EnvPool("user_envs:SlowLookupEnv", "compact", workers=2, threads=16,
                   timeout_s=10)
    try:
        rows = [ex.row for ex in lookup.sample_examples(32, "train", 0)]
        opened = _run(pool, [(i, "open", r) for i, r in enumerate(rows)])
        assert all(o[1][0] == "ok" for o in opened)
        t0 = time.monotonic()
        turns = _run(pool, [(i, "turn", "*" + r["prompt"][0]) for i, r in enumerate(rows)])
        took = time.monotonic() - t0
        assert all(o[1][0] == "ok" and o[1][1][0].endswith("=") for o in turns)
        assert took < 0.5, f"32 tools of 0-50 ms each took {took:.2f} s: not concurrent"
    finally:
        pool.close()


def test_env_pool_contains_errors_hangs_and_crashes():
    pool = EnvPool("user_envs:RaisingRewardEnv", "compact", workers=1, threads=4,
                   timeout_s=1.0)
    try:
        assert _run(pool, [(0, "open", {"prompt": "x"})])[0][1][0] == "ok"
        kind, what = _run(pool, [(0, "reward", "a")])[0][1]
        assert kind == "error" and "no reward for you" in what
    finally:
        pool.close()
    pool = EnvPool("user_envs:HangingEnv", "compact", workers=1, threads=4, timeout_s=1.0)
    try:
        _run(pool, [(0, "open", {"prompt": "x"}), (1, "open", {"prompt": "y"})])
        t0 = time.monotonic()
        assert _run(pool, [(0, "turn", "hi")])[0][1] == ("timeout", None)
        assert time.monotonic() - t0 < 5
        # the worker still serves other episodes while a thread hangs
        assert _run(pool, [(1, "reward", "a")])[0][1] == ("ok", 0.0)
    finally:
        pool.close()
    pool = EnvPool("user_envs:CrashingEnv", "compact", workers=1, threads=4, timeout_s=5.0)
    try:
        _run(pool, [(0, "open", {"prompt": "x"})])
        kind, what = _run(pool, [(0, "turn", "hi")])[0][1]
        assert kind == "error" and "died" in what
        assert pool.restarts == 1
    finally:
        pool.close()


def test_a_dead_worker_costs_only_the_episode_whose_call_killed_it():
    """A tool that kills its worker (os._exit) ends the episode whose call was running; the
    worker's other live episodes are rebuilt in the new worker from their calls (row, turns)
    and go on where they were (their turn counts continue), and a later episode is served."""
    pool = EnvPool("user_envs:CrashOnDieEnv", "compact", workers=1, threads=4, timeout_s=5.0)
    try:
        opened = _run(pool, [(e, "open", {"prompt": str(e)}) for e in range(4)])
        assert all(o[1][0] == "ok" for o in opened)
        assert [o[1] for o in _run(pool, [(e, "turn", "hi") for e in (1, 2, 3)])] == \
            [("ok", ("turn 1", {"tool_calls": 1, "tool_errors": 0, "malformed": 0}))] * 3
        kind, what = _run(pool, [(0, "turn", "die")])[0][1]
        assert kind == "error" and "died (exit code 3) during this call" in what
        assert pool.restarts == 1 and pool.replayed == 3
        turns = _run(pool, [(e, "turn", "hi") for e in (1, 2, 3)])
        assert [o[1][1][0] for o in turns] == ["turn 2"] * 3, turns
        assert [o[1] for o in _run(pool, [(e, "reward", "") for e in (1, 2, 3)])] == \
            [("ok", 2.0)] * 3
        assert _run(pool, [(0, "turn", "hi")])[0][1][0] == "error"  # (its episode ended)
        assert _run(pool, [(9, "open", {"prompt": "9"})])[0][1][0] == "ok"
    finally:
        pool.close()


def test_an_observation_that_is_not_valid_unicode_fails_its_own_call():
    pool = EnvPool("user_envs:SurrogateEnv", "compact", workers=1, threads=2, timeout_s=5.0)
    try:
        _run(pool, [(0, "open", {"prompt": "x"}), (1, "open", {"prompt": "y"})])
        kind, what = _run(pool, [(0, "turn", "hi")])[0][1]
        assert kind == "error" and "not valid Unicode" in what and "\\ud800" in what, what
        assert pool.restarts == 0
    finally:
        pool.close()


def test_unknown_environment_is_a_one_line_error():
    with pytest.raises(ValueError, match="user_envs:Nope"):
        EnvPool("user_envs:Nope", "compact", workers=1, threads=1, timeout_s=1)


QWEN_LIKE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user"
    "{% endif %}\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif -%}"
    "{%- else -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}")


def chat_tokenizer():
    """A character tokenizer with ChatML special tokens and a Qwen2.5-like tool template."""
    import string

    from llamarl.tiny.model import build_tokenizer

    tok = build_tokenizer(sorted(set(string.printable) - {"\x0b", "\x0c"}))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN_LIKE
    return tok


def test_chat_glue_continues_the_conversation_token_in_token_out():
    from llamarl.data.prompts import PromptFormatter
    from llamarl.rollout.context import ContextEncoder

    tok = chat_tokenizer()
    enc = ContextEncoder(tok, PromptFormatter(tok, chat_template=True))
    env = CalculatorEnv({"prompt": "What is 3*7?", "answer": "21"})
    ids = enc.prompt_ids(env.prompt())
    turn1 = ('<tool_call>{"name": "calculate", "arguments": {"expression": "3*7"}}'
             '</tool_call>')
    ids += tok.encode(turn1, add_special_tokens=False) + [tok.eos_token_id]  # as sampled
    obs, counts = env.turn(turn1, "hermes")
    ids += enc.observation_ids(obs, turn_ended_with_eos=True)
    turn2 = "3*7 = 21\n#### 21"
    ids += tok.encode(turn2, add_special_tokens=False) + [tok.eos_token_id]
    conversation = env.prompt() + [{"role": "assistant", "content": turn1}, *obs,
                                   {"role": "assistant", "content": turn2}]
    # the template closes the last message with a newline the policy never sampled
    assert tok.decode(ids) == tok.apply_chat_template(conversation, tokenize=False)[:-1]
    assert counts["tool_calls"] == 1 and env.reward(turn2) == 1.0


def test_three_turn_episodes_are_token_in_token_out(cache_dir, monkeypatch):
    """Real engine, real environment workers: the record holds the tokens exactly as sampled,
    so the trainer's recomputed logprobs match the engine's on every sampled token, and no
    observation token carries loss weight."""
    import json
    import subprocess
    import sys

    import torch
    from conftest import DIST, ROOT, child_env

    from llamarl.models.tiny import warm_start_dir
    from llamarl.trainer.warmstart import run_warm_start

    monkeypatch.setenv("LLAMARL_CACHE", str(cache_dir))
    path = warm_start_dir("reverse")
    if not (path / "config.json").is_file():
        run_warm_start("reverse", path, None, torch.device("cpu"))
    proc = subprocess.run([sys.executable, str(DIST / "multi_turn_episode.py"), str(path)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    three = sum(t == 3 for t in out["turns"])
    assert three >= 8, out  # most of the 32 episodes run all three turns
    assert out["max_abs_diff"] <= 1e-3, out
    assert out["masked_tokens_with_weight"] == 0
    assert out["versions"] == [7] and out["policy_version"] == [7]
    assert out["metrics"]["turns"] == sum(out["turns"])
    # a group stopped (continuous mode, its slot handed back): its turns leave the engine, the
    # other group completes, nothing is left in the runner or the environment workers
    abort = out["abort"]
    assert abort["returned"] == [1] and abort["running_after"] < abort["running_before"], abort
    assert abort["live"] == abort["engine_running"] == abort["calls_left"] == 0, abort
    assert abort["pending"] == 0, abort


class ScriptedEngine:
    """Stands in for the engine in the episode runner's unit tests (the real engine runs in
    test_three_turn_episodes_are_token_in_token_out): every turn is `reply` + EOS."""

    EOS = 2

    def __init__(self, tok, reply: str):
        self.tok, self.reply, self.queue = tok, reply, []

    def begin(self, seed):
        pass

    def submit(self, rid, ids, temperature, max_tokens):
        self.queue.append((rid, max_tokens))

    @property
    def busy(self):
        return bool(self.queue)

    def step(self):
        from llamarl.generator.engine import Completion

        out = []
        for rid, max_tokens in self.queue:
            ids = (self.tok.encode(self.reply) + [self.EOS])[:max_tokens]
            finish = "stop" if ids[-1] == self.EOS else "length"
            out.append((rid, Completion(ids, [-0.5] * len(ids), finish, self.reply)))
        self.queue = []
        return out


def _source(env: str, reply: str, *overrides: str):
    from llamarl.config import load_config
    from llamarl.data.prompts import PromptFormatter
    from llamarl.rollout.multi_turn import MultiTurnSource
    from llamarl.rollout.source import SourceContext
    from llamarl.tiny.model import build_tokenizer

    cfg = load_config("recipes/tiny_tool_cpu.yaml", [f"rollout.env={env}", "rollout.workers=1",
                                                     "rollout.timeout_s=1", *overrides])
    tok = build_tokenizer()
    fmt = PromptFormatter(tok)
    src = MultiTurnSource(SourceContext(cfg, ScriptedEngine(tok, reply), tok, fmt, None))
    return src, fmt.encode(lookup.sample_examples(2, "train", 0))


def test_episode_limits_end_episodes_with_a_finish_reason():
    src, prompts = _source("lookup", "*a")  # a policy that only ever calls the tool
    try:
        got = src.collect(prompts, 2, 1.0, 0, version=3, step=0)
        assert {s.finish for g in got.groups for s in g.samples} == {"max_turns"}
        assert all(s.turns == 4 for g in got.groups for s in g.samples)
        assert got.metrics["tool_calls"] == 16 and all(r == [0.0, 0.0] for r in
                                                       (g.rewards for g in got.groups))
    finally:
        src.close()
    src, prompts = _source("lookup", "*a", "rollout.max_tokens=12")
    try:
        got = src.collect(prompts, 1, 1.0, 0, version=0, step=0)
        assert {s.finish for g in got.groups for s in g.samples} <= {"context", "length"}
        assert all(len(s.token_ids) <= 12 for g in got.groups for s in g.samples)
    finally:
        src.close()


def test_failing_environments_follow_on_error():
    src, prompts = _source("user_envs:RaisingRewardEnv", "hi")
    try:
        with pytest.raises(RuntimeError, match="RaisingRewardEnv.*reward raised ValueError: "
                                               "no reward for you.*on_error=zero"):
            src.collect(prompts, 1, 1.0, 0, version=0, step=0)
    finally:
        src.close()
    src, prompts = _source("user_envs:HangingEnv", "hi", "rollout.on_error=zero")
    try:
        t0 = time.monotonic()
        got = src.collect(prompts, 2, 1.0, 0, version=0, step=0)
        assert time.monotonic() - t0 < 10
        assert {s.finish for g in got.groups for s in g.samples} == {"env_error"}
        assert got.metrics["env_timeouts"] == 4 and [g.rewards for g in got.groups] == \
            [[0.0, 0.0], [0.0, 0.0]]
    finally:
        src.close()
    src, prompts = _source("user_envs:BrokenPromptEnv", "hi", "rollout.on_error=zero")
    try:  # an episode that never started keeps its prompt, with nothing to train on
        got = src.collect(prompts, 1, 1.0, 0, version=0, step=0)
        assert [g.samples[0].token_ids for g in got.groups] == [p.token_ids for p in prompts]
        assert got.metrics["env_errors"] == 2
    finally:
        src.close()


def test_tool_recipe_trains_through_the_launcher(tmp_path, cache_dir):
    """recipes/tiny_tool_cpu.yaml as a user launches it (3 ranks, the lookup warm start built
    on first use): episodes with tool calls reach the trainer, metrics and evaluations carry
    the multi-turn figures. (Learning itself is measured in the README: +0.57 held-out.)"""
    import json

    from conftest import torchrun

    proc = torchrun(3, ["-m", "llamarl.launch", "recipes/tiny_tool_cpu.yaml", "run.steps=3",
                        "run.eval_every=0", "data.eval_prompts=16", f"run.output_dir={tmp_path}"],
                    timeout=900, LLAMARL_CACHE=str(cache_dir))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert row["turns_per_episode"] >= 1 and 0 <= row["engine_busy_share"] <= 1
        assert 0 < row["masked_response_share"] < 1  # observations are in the record, masked
        assert sum(v for k, v in row.items() if k.startswith("episodes_")) == 32 * 8
    assert any(row["tool_calls_per_episode"] > 0 for row in rows)
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 3] and "tool_calls_per_episode" in evals[0]


def test_environments_get_the_mapped_prompt_and_answer_with_the_whole_row():
    from llamarl.data.prompts import Prompt
    from llamarl.rollout.episodes import episode_row

    row = {"question": "What is 3*7?", "answer": "3*7 = 21 #### 21", "id": 4}
    prompt = Prompt([1, 2], "What is 3*7?", "3*7 = 21 #### 21", row)
    got = episode_row(prompt)
    assert got == {**row, "prompt": "What is 3*7?"}
    env = CalculatorEnv(got)  # GSM8K's field names: the environment still finds its prompt
    assert env.prompt()[-1]["content"] == "What is 3*7?" and env.reward("#### 21") == 1.0
