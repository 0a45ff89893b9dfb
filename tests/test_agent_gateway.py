"""rollout.source = agent: the gateway's request checks, token-exact capture (splicing, chains,
prefix breaks), vLLM's tool parser, and a live engine serving real `openai` clients in agent
workers (tests/dist/agent_episodes.py, run once for the module)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_multi_turn import chat_tokenizer

from llamarl.gateway.requests import (
    GatewayError,
    chat_request,
    completion_request,
    parse_json,
    parse_messages,
)
from llamarl.generator.engine import Completion
from llamarl.rollout.agent_worker import BadResult, agent_result
from llamarl.rollout.capture import EpisodeCapture, Renderer, message_key

OK = [{"role": "user", "content": "hi"}]
WEATHER = [{"type": "function", "function": {
    "name": "temperature", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]


def _refused(fn, *args) -> GatewayError:
    with pytest.raises(GatewayError) as e:
        fn(*args)
    return e.value


@pytest.mark.parametrize("body, status, param", [
    ({"model": "gpt-9", "messages": OK}, 404, "model"),
    ({"model": "policy", "messages": OK, "temperature": 0.7}, 400, "temperature"),
    ({"model": "policy", "messages": OK, "top_p": 0.9}, 400, "top_p"),
    ({"model": "policy", "messages": OK, "n": 0}, 400, "n"),
    ({"model": "policy", "messages": OK, "stream": "yes"}, 400, "stream"),
    ({"model": "policy", "messages": OK, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ({"model": "policy", "messages": OK, "tool_choice": "required"}, 400, "tool_choice"),
    ({"model": "policy", "messages": OK, "tools": WEATHER, "tool_choice": {
        "type": "function", "function": {"name": "wind"}}}, 400, "tool_choice"),
    ({"model": "policy", "messages": []}, 400, "messages"),
    ({"model": "policy", "messages": OK + [{"role": "tool", "tool_call_id": "nope",
                                            "content": "4 C"}]}, 400, "messages[1].tool_call_id"),
    ({"model": "policy", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0]"),
    ({"model": "policy", "messages": OK, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nonsense"}}}]}, 400,
     "tools[0].function.parameters"),
    ({"model": "policy", "messages": OK, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": "not a schema"}}]}, 400, "tools[0].function.parameters"),
])
def test_chat_requests_outside_the_training_sampler_or_malformed_are_refused(body, status,
                                                                             param):
    e = _refused(chat_request, body, "policy", 1.0)
    assert (e.status, e.param) == (status, param), e.message
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, status, param", [
    ({"token_ids": [1], "model": "gpt-9", "sampling_params": {}}, 404, "model"),
    ({"token_ids": [1]}, 400, "sampling_params"),
    ({"token_ids": [], "sampling_params": {}}, 400, "token_ids"),
    ({"token_ids": [1, -2], "sampling_params": {}}, 400, "token_ids"),
    ({"token_ids": [1], "stream": "maybe", "sampling_params": {}}, 400, "stream"),
    ({"token_ids": [1], "sampling_params": {"temperature": 0.7}}, 400,
     "sampling_params.temperature"),
    ({"token_ids": [1], "sampling_params": {"top_p": 5}}, 400, "sampling_params.top_p"),
    ({"token_ids": [1], "sampling_params": {"top_p": 0.5}}, 400, "sampling_params.top_p"),
    ({"token_ids": [1], "sampling_params": {"top_k": 5}}, 400, "sampling_params.top_k"),
    ({"token_ids": [1], "sampling_params": {"min_tokens": 2}}, 400,
     "sampling_params.min_tokens"),
    ({"token_ids": [1], "sampling_params": {"repetition_penalty": 1.2}}, 400,
     "sampling_params.repetition_penalty"),
    ({"token_ids": [1], "sampling_params": {"stop_token_ids": [3]}}, 400,
     "sampling_params.stop_token_ids"),
    ({"token_ids": [1], "sampling_params": {"logprobs": 5}}, 400, "sampling_params.logprobs"),
    ({"token_ids": [1], "sampling_params": {"n": 17}}, 400, "sampling_params.n"),
])
def test_token_endpoint_requests_outside_the_training_sampler_or_malformed_are_refused(
        body, status, param):
    from llamarl.gateway.requests import generate_request

    e = _refused(generate_request, body, "policy", 1.0)
    assert (e.status, e.param) == (status, param), e.message


ANTHROPIC_OK = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user",
                                                                 "content": "hi"}]}


@pytest.mark.parametrize("extra, status, param", [
    ({"model": "claude-9"}, 404, "model"),
    ({"max_tokens": None}, 400, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ({"temperature": 0.2}, 400, "temperature"),
    ({"top_k": 5}, 400, "top_k"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 4096}, 400,
     "thinking"),
    ({"tools": [{"name": "f", "input_schema": {"type": "nonsense"}}]}, 400,
     "tools[0].function.parameters"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope",
                                                 "content": "4 C"}]}]}, 400,
     "messages[0].tool_call_id"),
])
def test_messages_requests_outside_the_training_sampler_or_malformed_are_refused(
        extra, status, param):
    from llamarl.gateway.messages import messages_request

    body = {k: v for k, v in {**ANTHROPIC_OK, **extra}.items() if v is not None}
    e = _refused(messages_request, body, "policy", 1.0)
    assert (e.status, e.param) == (status, param), e.message


def test_a_messages_request_is_the_chat_request_of_its_blocks():
    """system, text, tool_use and tool_result blocks as the chat messages the template sees
    (vLLM's converter), the tool as a function."""
    from llamarl.gateway.messages import messages_request

    req = messages_request({**ANTHROPIC_OK, "system": "Be brief.", "stop_sequences": ["\n"],
                            "tools": [{"name": "temperature", "input_schema": {
                                "type": "object", "properties": {"city": {"type": "string"}}}}],
                            "messages": [
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                           "name": "temperature", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "4 C"}]}]}, "policy", 1.0)
    assert [(m["role"], m["content"]) for m in req.messages] == [
        ("system", "Be brief."), ("user", "Oslo?"), ("assistant", None), ("tool", "4 C")]
    assert req.messages[2]["tool_calls"][0]["function"] == {"name": "temperature",
                                                            "arguments": {"city": "Oslo"}}
    assert req.messages[3]["tool_call_id"] == "t1"
    assert req.tools[0]["function"]["name"] == "temperature"
    assert (req.sampling.max_tokens, req.sampling.stop) == (8, ["\n"])


@pytest.mark.parametrize("extra, status, param", [
    ({"model": "gpt-9"}, 404, "model"),
    ({"input": 3}, 400, "input.str"),
    ({"temperature": 0.2}, 400, "temperature"),
    ({"top_p": 0.5}, 400, "top_p"),
    ({"text": {"format": {"type": "json_object"}}}, 400, "text.format"),
    ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "4 C"}]}, 400,
     "messages[0].tool_call_id"),
])
def test_responses_requests_outside_the_training_sampler_or_malformed_are_refused(
        extra, status, param):
    from llamarl.gateway.responses_api import responses_request

    body = {"model": "policy", "input": "hi", **extra}
    with pytest.raises(GatewayError) as e:
        responses_request(body, "policy", 1.0, previous=lambda rid: None)
    assert (e.value.status, e.value.param) == (status, param), e.value.message


def test_a_responses_request_continues_its_previous_response():
    """instructions -> system (not carried over), the earlier conversation, function_call
    items -> the assistant's tool_calls, function_call_output -> a tool message."""
    from llamarl.gateway.responses_api import responses_request

    earlier = [{"role": "system", "content": "Old."}, {"role": "user", "content": "Oslo?"}]
    req, _ = responses_request({"model": "policy", "instructions": "Be brief.",
                                "previous_response_id": "resp_1", "input": [
        {"type": "function_call", "call_id": "c1", "name": "temperature",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "4 C"}]},
        "policy", 1.0, previous={"resp_1": earlier}.get)
    assert [(m["role"], m["content"]) for m in req.messages] == [
        ("system", "Be brief."), ("user", "Oslo?"), ("assistant", None), ("tool", "4 C")]
    assert req.messages[2]["tool_calls"][0]["function"] == {"name": "temperature",
                                                            "arguments": {"city": "Oslo"}}


def test_token_endpoint_requests_in_the_training_sampler_are_accepted():
    from llamarl.gateway.requests import generate_request

    req = generate_request({"token_ids": [4, 2], "model": "policy", "output_mode": "text",
                            "request_id": "r1", "return_token_ids": True, "sampling_params": {
                                "max_tokens": 3, "stop": ["x"], "logprobs": 0, "seed": 3,
                                "n": 2, "temperature": 0.5}}, "policy", 0.5)
    assert (req.token_ids, req.text, req.request_id, req.return_token_ids) == \
        ([4, 2], True, "r1", True)
    assert (req.sampling.n, req.sampling.max_tokens, req.sampling.stop,
            req.sampling.logprobs) == (2, 3, ["x"], True)
    # left out: the engine's own budget and the training temperature, not vLLM's defaults
    req = generate_request({"token_ids": [4], "sampling_params": {}}, "policy", 0.5)
    assert (req.sampling.max_tokens, req.sampling.logprobs, req.text) == (None, False, False)


def test_requests_in_the_training_sampler_are_accepted():
    req = chat_request({"model": "policy", "messages": OK, "temperature": 1.0, "top_p": 1,
                        "max_tokens": 9, "max_completion_tokens": 5, "stop": "\n", "n": 2,
                        "logprobs": True, "tools": WEATHER, "seed": 3}, "policy", 1.0)
    assert (req.sampling.n, req.sampling.max_tokens, req.sampling.stop) == (2, 5, ["\n"])
    assert completion_request({"model": "policy", "prompt": [1, 2, 3]}, "policy",
                              1.0).prompt == [1, 2, 3]
    assert _refused(parse_json, b"{not json").code == "invalid_json"
    assert _refused(completion_request, {"model": "policy", "prompt": "x", "echo": True},
                    "policy", 1.0).param == "echo"


def _completion(tok, text: str, eos: bool = True) -> Completion:
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
    return Completion(ids, [-0.5] * len(ids), "stop" if eos else "length", text)


def test_chat_calls_splice_the_sampled_ids_and_merge_into_one_sequence():
    tok = chat_tokenizer()
    cap = EpisodeCapture(Renderer(tok))
    ids1 = cap.chat_prompt(OK, None)
    c1 = _completion(tok, "yo")
    reply = {"role": "assistant", "content": "yo"}
    cap.record(ids1, [c1], [reply], messages=OK)
    history = OK + [reply, {"role": "tool", "content": "12 C"}]
    ids2 = cap.chat_prompt(history, None)
    assert ids2[:len(ids1) + 3] == ids1 + c1.token_ids and cap.spliced == 1
    # the glue continues the conversation exactly as the template renders it
    assert tok.decode(ids2) == tok.apply_chat_template(history, tokenize=False,
                                                       add_generation_prompt=True)
    c2 = _completion(tok, "hot", eos=False)
    cap.record(ids2, [c2], [{"role": "assistant", "content": "hot"}], messages=history)
    sample, counts = cap.sample(version=5)
    assert sample.token_ids == ids2 + c2.token_ids
    assert [v for v in sample.versions if v >= 0] == [5, 5] and sample.turns == 2
    assert sample.logprobs == c1.logprobs + c2.logprobs
    assert counts == {"prefix_breaks": 0, "spliced_calls": 1, "model_calls": 2,
                      "dropped_sampled_tokens": 0}
    # an edited history extends no earlier call: a prefix break; the last chain trains
    edited = [{"role": "user", "content": "hello"}, reply, {"role": "user", "content": "?"}]
    ids3 = cap.chat_prompt(edited, None)
    c3 = _completion(tok, "ok")
    cap.record(ids3, [c3], [{"role": "assistant", "content": "ok"}], messages=edited)
    sample, counts = cap.sample(version=6)
    assert sample.token_ids == ids3 + c3.token_ids and sample.turns == 1
    assert counts["prefix_breaks"] == 1
    assert counts["dropped_sampled_tokens"] == len(c1.token_ids) + len(c2.token_ids)


def test_completion_calls_splice_text_continuations_token_for_token():
    """The tiny lookup agent's pattern: prompt, then prompt + turn + observation."""
    from llamarl.tiny.model import build_tokenizer

    tok = build_tokenizer()
    cap = EpisodeCapture(Renderer(tok))
    ids1 = cap.text_prompt("ab=")
    assert ids1 == [tok.bos_token_id] + tok.encode("ab=", add_special_tokens=False)
    c1 = _completion(tok, "*a")
    cap.record(ids1, [c1], ["*a"], prompt_text="ab=")
    ids2 = cap.text_prompt("ab=*a3=")
    assert ids2 == ids1 + c1.token_ids + tok.encode("3=", add_special_tokens=False)
    cap.record(ids2, [_completion(tok, "3")], ["3"], prompt_text="ab=*a3=")
    sample, counts = cap.sample(0)
    assert sample.turns == 2 and counts["prefix_breaks"] == 0


def test_tool_calls_are_parsed_by_vllms_hermes_parser_and_spliced_when_sent_back():
    from llamarl.gateway.responses import chat_message, tool_parser

    tok = chat_tokenizer()
    parser = tool_parser("hermes", tok)
    text = 'Let me see. <tool_call>{"name": "temperature", "arguments": {"city": "Oslo"}}' \
           '</tool_call>'
    msg, called, unknown = chat_message(text, parser, WEATHER, "auto", "policy")
    assert unknown == 0
    assert called and msg["content"] == "Let me see. "
    fn = msg["tool_calls"][0]["function"]
    assert fn["name"] == "temperature" and json.loads(fn["arguments"]) == {"city": "Oslo"}
    assert chat_message(text, parser, WEATHER, "none", "policy")[0]["content"] == text
    # what the openai client sends back (arguments as a JSON string) keys as the reply did
    from llamarl.gateway.requests import ChatRequest, Sampling
    from llamarl.gateway.responses import chat_response

    req = ChatRequest(OK, WEATHER, "auto", Sampling())
    _, keyed, _ = chat_response(req, [1], [_completion(tok, text)], parser, tok, "policy")
    echoed = parse_messages([{"role": "assistant", "content": msg["content"],
                         "tool_calls": msg["tool_calls"]}])[0]
    assert message_key(echoed) == message_key(keyed[0])
    with pytest.raises(ValueError, match="rollout.tool_parser"):
        tool_parser("nope", tok)
    # a call to a tool the request did not offer: the reply is the model's text, counted
    wind = '<tool_call>{"name": "wind", "arguments": {}}</tool_call>'
    assert chat_message(wind, parser, WEATHER, "auto", "policy") == (
        {"role": "assistant", "content": wind}, False, 1)


def test_what_an_agent_returns_must_be_a_reward():
    assert agent_result(1) == (1.0, {})
    assert agent_result({"reward": 0.5, "metrics": {"calls": 3}}) == (0.5, {"calls": 3.0})
    for bad in ("sunny", None, float("nan"), True, {"score": 1}, {"reward": 1, "metrics": 3}):
        with pytest.raises(BadResult):
            agent_result(bad)


def run_on_chat_model(script: str, path, positions: int = 128) -> dict:
    """A tiny chat model (random weights, chat_tokenizer, `positions` positions) saved at
    `path`, and the JSON that tests/dist/`script` prints for it."""
    import torch
    from conftest import DIST, ROOT, child_env
    from transformers import Qwen2ForCausalLM

    from llamarl.tiny.model import build_config, save_hf_dir

    tok = chat_tokenizer()
    config = build_config(len(tok))
    config.eos_token_id = tok.eos_token_id
    config.max_position_embeddings = positions
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    save_hf_dir(path, model.state_dict(), model.config, tok)
    proc = subprocess.run([sys.executable, str(DIST / script), str(path)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The episodes of tests/dist/agent_episodes.py on a tiny chat model (random weights)."""
    return run_on_chat_model("agent_episodes.py", tmp_path_factory.mktemp("chat") / "model")


def _engine_chain(live, episode: int, calls: list[int]) -> list[int]:
    return [t for c in calls for t in live["engine"][str(episode)][c]]


def test_trained_tokens_are_the_engines_sampled_tokens(live):
    """Episode ids follow the groups (2 episodes each): chat_tools 0-1, edits_history 2-3,
    no_model 4-5, fifty_calls 6-7, two_choices 8-9, malformed 10-11, stops 12-13,
    null_content 14-15, generate_tokens 16-17, streams 18-19, anthropic_messages 20-21,
    responses_api 22-23, forced_tools 24-25."""
    for e in (0, 1):  # two chat calls with tools, the second spliced: one sequence
        assert live["chat_tools"]["sampled"][e] == _engine_chain(live, e, [0, 1])
    assert live["chat_tools"]["turns"] == [2, 2]
    assert live["chat_tools"]["finish"][0] != "env_error"
    for e in (6, 7):  # 50 calls: one sequence of 50 turns
        assert live["fifty_calls"]["sampled"][e - 6] == _engine_chain(live, e, range(50))
    assert live["fifty_calls"]["turns"] == [50, 50] and live["fifty_calls"]["rewards"] == [1, 1]
    # trainer logprobs recomputed from the record match the engine's
    assert live["max_abs_diff"] <= 1e-3 and live["sampled_tokens"] > 100
    assert live["versions"] == [3]


def test_prefix_breaks_no_calls_and_several_choices(live):
    m = live["metrics"]
    for e in (2, 3):  # the edited history: only the last call's chain trains
        assert live["edits_history"]["sampled"][e - 2] == _engine_chain(live, e, [1])
    assert m["prefix_breaks"] == 2
    assert live["no_model"] == {"rewards": [0.25, 0.25], "finish": ["stop", "stop"],
                                "turns": [0, 0], "sampled": [[], []]}
    for e in (8, 9):  # n = 2: the first choice trains, the second is dropped (counted)
        assert live["two_choices"]["sampled"][e - 8] == _engine_chain(live, e, [0])
    assert live["two_choices"]["rewards"] == [2.0, 2.0]
    # dropped: the edited history's first calls (up to 4 tokens each) and the second choices
    # (up to 3): counted from what the engine sampled, which may end at EOS before the limit
    # (the random model's samples depend on how the concurrent calls were batched)
    dropped = ([live["engine"][str(e)][0] for e in (2, 3)]
               + [live["engine"][str(e)][1] for e in (8, 9)])
    assert [len(d) <= cap for d, cap in zip(dropped, (4, 4, 3, 3))] == [True] * 4
    assert m["dropped_sampled_tokens"] == sum(len(d) for d in dropped) > 0


def test_malformed_requests_get_openai_errors(live):
    m = {k.removeprefix("agent_status_"): v / 2 for k, v in live["metrics"].items()
         if k.startswith("agent_status_")}  # (summed over the group's 2 episodes)
    assert m == {"bad_json": 400, "unknown_model": 404, "bad_schema": 400, "no_token": 401,
                 "wrong_token": 401, "temperature": 400, "stream": 400, "unknown_route": 404,
                 "client_not_found": 404}
    assert live["malformed"]["rewards"] == [1.0, 1.0]  # GET /v1/models served "policy"


def test_stop_strings_cut_the_text_and_keep_the_engines_tokens(live):
    for e in (12, 13):
        assert live["stops"]["sampled"][e - 12] == _engine_chain(live, e, [0, 1])
    assert live["stops"]["rewards"] == [1.0, 1.0]  # no stop string in the returned text


def test_the_token_endpoint_records_token_exact_and_refuses_what_it_cannot_serve(live):
    """POST /inference/v1/generate (tests/user_agents.py:generate_tokens): ids in, ids and
    logprobs out; each call's ids extend the previous prompt + sampled ids (the third
    streamed as vLLM streams it), so the episode trains one sequence of the three, the
    engine's own ids; a top_p and an id outside the vocabulary are 400s naming the field."""
    got = live["generate_tokens"]
    assert got["rewards"] == [1.0, 1.0] and got["turns"] == [3, 3], got
    for e in (16, 17):  # (the third call streamed)
        assert got["sampled"][e - 16] == _engine_chain(live, e, [0, 1, 2])
    m = live["metrics"]
    assert m["agent_bad_top_p"] / 2 == 400 and m["agent_bad_id"] / 2 == 400
    assert m["agent_bad_top_p_named"] == m["agent_bad_id_named"] == 2.0  # (both episodes)


def test_streamed_calls_are_what_the_sdk_assembles_and_train_token_exact(live):
    """stream=True through the openai SDK (tests/user_agents.py:streams): the deltas assemble
    to the reply (content, finish reason, per-token logprobs, the usage chunk), sent back it
    is spliced, and the episode trains on the engine's ids; a client that drops a stream
    after one event ends only its own request (stream_dropped)."""
    got = live["streams"]
    assert got["rewards"] == [1.0, 1.0] and got["turns"] == [2, 2], got
    for e in (18, 19):
        assert got["sampled"][e - 18] == _engine_chain(live, e, [0, 1])
    assert live["stream_dropped"]["rewards"] == [[1.0, 1.0]], live["stream_dropped"]
    assert live["stream_dropped"]["metrics"]["agent_errors"] == 0


def test_the_anthropic_sdk_speaks_the_messages_dialect_token_exact(live):
    """The `anthropic` SDK (tests/user_agents.py:anthropic_messages): messages.stream's text
    equals its final message, sent back as blocks it is spliced (the episode trains on the
    engine's ids), and an unknown model is the SDK's own NotFoundError."""
    got = live["anthropic_messages"]
    assert got["rewards"] == [1.0, 1.0] and got["turns"] == [2, 2], got
    for e in (20, 21):
        assert got["sampled"][e - 20] == _engine_chain(live, e, [0, 1])
    assert live["metrics"]["agent_not_found"] >= 2.0  # (responses_api's add 2)


def test_the_responses_api_continues_by_previous_response_id_token_exact(live):
    """The Responses API through the openai SDK (tests/user_agents.py:responses_api): calls
    continued by previous_response_id (one streamed) train one sequence of the engine's ids;
    an unknown id is the SDK's NotFoundError. The Agents SDK's default model (the Responses
    API) runs its loop on the gateway."""
    got = live["responses_api"]
    assert got["rewards"] == [1.0, 1.0] and got["turns"] == [3, 3], got
    for e in (22, 23):
        assert got["sampled"][e - 22] == _engine_chain(live, e, [0, 1, 2])
    assert live["metrics"]["agent_not_found"] == 4.0  # (with anthropic_messages' 2)
    if "sdk_responses" in live:
        sdk = live["sdk_responses"]
        # 1: the loop ended with a final answer; 0.5: the SDK parsed the response and refused
        # it as incomplete (max_output_tokens), as it does OpenAI's
        assert all(r in (0.5, 1.0) for r in sdk.get("rewards", [[0]])[0]), sdk
        assert sdk["metrics"]["model_calls"] >= 2 and sdk["metrics"]["agent_errors"] == 0


def test_a_forced_tool_choice_is_prefilled_and_trains_only_what_was_sampled(live):
    """tool_choice a named function and required (tests/user_agents.py:forced_tools): each
    reply begins with the call's start, which the gateway wrote into the prompt (context,
    masked out); the trained tokens are the engine's sampled ids alone, spliced into one
    sequence."""
    got = live["forced_tools"]
    assert got["rewards"] == [1.0, 1.0] and got["turns"] == [2, 2], got
    for e in (24, 25):
        assert got["sampled"][e - 24] == _engine_chain(live, e, [0, 1])


def test_the_start_of_a_forced_call_is_written_as_the_model_writes_it():
    from llamarl.gateway.responses import forced_call_prefix

    assert forced_call_prefix("hermes", "auto", None) == ""
    assert forced_call_prefix("hermes", "required", None) == '<tool_call>\n{"name": "'
    assert forced_call_prefix("hermes", "function", "f") == \
        '<tool_call>\n{"name": "f", "arguments": '
    with pytest.raises(ValueError, match="rollout.tool_parser hermes, not 'mistral'"):
        forced_call_prefix("mistral", "required", None)


def test_a_history_whose_assistant_turns_carry_null_content_trains(live):
    """tests/user_agents.py:null_content: a few-shot assistant turn with content null and
    tool calls, and replies sent back with their null fields; both calls answered, spliced
    into one trained sequence."""
    got = live["null_content"]
    assert got["rewards"] == [1.0, 1.0] and got["turns"] == [2, 2], got
    for e in (14, 15):
        assert got["sampled"][e - 14] == _engine_chain(live, e, [0, 1])


def test_failing_agents_fail_their_episode_never_the_run(live):
    f = live["failing"]  # exits (its own worker), hangs, raises, not a number, no model
    assert f["rewards"] == [[0.0], [0.0], [0.0], [0.0], [0.25]]
    assert f["finish"][:4] == [["env_error"]] * 4 and f["finish"][4] == ["stop"]
    assert f["metrics"]["agent_timeouts"] == 1 and f["metrics"]["agent_errors"] == 3
    assert f["restarts"] == 1 and f["seconds"] < 10
    assert live["async"]["rewards"] == [[0.75, 0.75], [0.75, 0.75]]
    # every episode of a batch failing is a broken agent: the run stops, naming the error
    assert "every episode of the batch failed" in live["all_fail"]["error"]
    assert "KeyError" in live["all_fail"]["error"]


def test_the_docs_example_agent_runs_as_written(live):
    doc = live["docs_example"]  # docs/agents.md's weather_agent, copied out of the page
    assert doc["rewards"] == [[1.0, 1.0]], doc  # (the test rows' answer is "")
    assert doc["metrics"]["agent_errors"] == 0 and doc["metrics"]["model_calls"] >= 2


def test_an_openai_agents_sdk_agent_trains_through_the_gateway(live):
    pytest.importorskip("agents")
    sdk = live["sdk"]
    assert sdk["rewards"] == [[1.0, 1.0]], sdk
    assert sdk["metrics"]["model_calls"] >= 2 and sdk["metrics"]["agent_errors"] == 0


@pytest.mark.slow
def test_agent_recipe_trains_through_the_launcher(tmp_path, cache_dir):
    """recipes/tiny_agent_cpu.yaml as a user launches it (3 ranks), in continuous generation:
    agent episodes reach the trainer with the agent metrics, and the run ends without a
    traceback (calls of episodes stopped with the run are answered, not cancelled). (Batch
    generation through the launcher: the SmolLM2 agent recipe, tests/test_smollm2_e2e.py, and
    the `live` gateway above. Learning itself is measured in docs/agents.md.)"""
    from conftest import torchrun

    mode = ["generator.mode=continuous", "sync.max_staleness=1"]
    proc = torchrun(3, ["-m", "llamarl.launch", "recipes/tiny_agent_cpu.yaml", "run.steps=3",
                        "run.eval_every=0", "data.eval_prompts=16", f"run.output_dir={tmp_path}",
                        "generator.prompts_per_step=16",
                        *mode], timeout=900, LLAMARL_CACHE=str(cache_dir))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "Traceback" not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-4000:]
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert row["model_calls_per_episode"] >= 1 and row["agent_errors"] == 0
        assert row["prefix_breaks"] == 0 and 0 < row["masked_response_share"] < 1
        assert sum(v for k, v in row.items() if k.startswith("episodes_")) == 16 * 8
    assert any(row["agent_tool_calls"] > 0 for row in rows)


def test_null_or_missing_content_renders_as_the_model_saw_it_in_smollm2s_template(
        smollm2_cache, monkeypatch):
    """SmolLM2's template concatenates content (None raised TypeError: every request with
    an assistant turn of content null and tool calls was refused) and has no tool support:
    the calls are written into the turn as the model writes them (hermes), or as it sampled
    them where the episode recorded that turn."""
    from transformers import AutoTokenizer

    from llamarl.models import smollm2

    monkeypatch.setenv("LLAMARL_CACHE", smollm2_cache)
    tok = AutoTokenizer.from_pretrained(smollm2.model_dir("135m-instruct"))
    renderer = Renderer(tok, "hermes")
    assert not renderer.renders_tool_calls
    call = {"id": "c1", "type": "function",
            "function": {"name": "calculate", "arguments": '{"expression": "12*34"}'}}
    history = parse_messages([{"role": "system", "content": "S"},
                         {"role": "user", "content": "12*34?"},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "408"},
                         {"role": "assistant", "tool_calls": [call]},  # content missing
                         {"role": "tool", "tool_call_id": "c1", "content": "408"},
                         {"role": "user", "content": "56*78?"}])
    cap = EpisodeCapture(renderer)
    written = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12*34"}}\n' \
              '</tool_call>'
    expected = ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n12*34?<|im_end|>\n"
                f"<|im_start|>assistant\n{written}<|im_end|>\n"
                "<|im_start|>tool\n408<|im_end|>\n"
                f"<|im_start|>assistant\n{written}<|im_end|>\n"
                "<|im_start|>tool\n408<|im_end|>\n"
                "<|im_start|>user\n56*78?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(cap.chat_prompt(history, None)) == expected
    assert history[2]["content"] is None  # (the request's messages are not changed)
    # a turn the engine sampled in this episode, sent back in a history that cannot be
    # spliced (its first message edited): rendered with the sampled text
    sampled = '<tool_call>{"name":"calculate","arguments":{"expression":"12*34"}}</tool_call>'
    first = history[:2]
    ids = cap.chat_prompt(first, None)
    c = _completion(tok, sampled)
    reply = {"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "calculate", "arguments": {"expression": "12*34"}}}]}
    cap.record(ids, [c], [reply], messages=first)
    edited = [{"role": "system", "content": "S2"}, *history[1:4]]
    text = tok.decode(cap.chat_prompt(edited, None))
    assert f"<|im_start|>assistant\n{sampled}<|im_end|>\n<|im_start|>tool\n408" in text
    # a template printing content with {{ }} (the tests' Qwen-like one) showed None as "None"
    qwen = Renderer(chat_tokenizer(), "hermes")
    assert "None" not in chat_tokenizer().decode(qwen.chat(history, None))


def test_a_run_whose_every_request_is_refused_stops_with_the_reason(tmp_path, cache_dir):
    """tests/user_agents.py:all_refused through the launcher: each step's episodes sample
    nothing; metrics.jsonl counts the gateway's 4xx answers with their reason, each such step
    is warned about, and run.max_empty_steps of them in a row stop the run with one line
    (before: it trained on nothing for all its steps and exited 0)."""
    from conftest import ROOT

    cmd = [sys.executable, "-m", "llamarl.launch", "recipes/tiny_agent_cpu.yaml",
           "rollout.agent=user_agents:all_refused", "trainer.ranks=1", "run.steps=6",
           "run.max_empty_steps=2", "run.eval_every=0", "data.eval_prompts=4",
           "data.eval_samples_per_prompt=1", "generator.prompts_per_step=4",
           "generator.samples_per_prompt=2", "rollout.threads_per_worker=8",
           f"run.output_dir={tmp_path}"]
    from conftest import child_env

    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=child_env(LLAMARL_CACHE=cache_dir,
                                        PYTHONPATH=str(ROOT / "tests")))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    reason = "400_invalid_value_temperature"
    assert (f"2 steps in a row sampled no token; the gateway refused 8 requests, most of them "
            f"{reason}") in out, out[-3000:]
    assert "warning: step 1: its episodes sampled no token" in out, out[-3000:]
    assert f"the gateway answered {reason}: temperature: 0.3" in out, out[-3000:]
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["tokens_generated"], r["gateway_4xx"], r["gateway_4xx_reason"])
            for r in rows] == [(1, 0, 8, reason), (2, 0, 8, reason)]


def test_a_reply_with_tool_calls_streams_as_openai_chunks():
    from llamarl.gateway.streaming import chat_chunks

    body = {"id": "c1", "created": 7, "model": "policy", "usage": {"prompt_tokens": 3,
            "completion_tokens": 2, "total_tokens": 5},
            "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None,
                         "message": {"role": "assistant", "content": "Hm. ", "tool_calls": [
                             {"id": "call_9", "type": "function", "function": {
                                 "name": "temperature", "arguments": '{"city": "Oslo"}'}}]}}]}
    events = chat_chunks(body, include_usage=True)
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 5
    deltas = [c["choices"][0]["delta"] for c in chunks[:4]]
    assert deltas[:2] == [{"role": "assistant", "content": ""}, {"content": "Hm. "}]
    assert deltas[2]["tool_calls"] == [{"index": 0, "id": "call_9", "type": "function",
                                        "function": {"name": "temperature",
                                                     "arguments": '{"city": "Oslo"}'}}]
    assert chunks[3]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["total_tokens"] == 5
