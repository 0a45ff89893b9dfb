"""Agents for the gateway tests (tests/test_agent_gateway.py, tests/dist/agent_episodes.py):
real `openai` clients against a live engine. `scenario` dispatches on the row's "kind"."""

from __future__ import annotations

import json
import os
import time

import httpx
import openai

WEATHER = [{"type": "function", "function": {
    "name": "temperature", "description": "The temperature in a city, in C.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def chat_tools(client, row):
    """Two chat calls with tools; the history grows by the returned assistant message and a
    tool result (what an agent loop does), so the second call is spliced."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"}]
    for i in range(2):
        out = client.chat.completions.create(model="policy", messages=messages,
                                             tools=WEATHER, max_tokens=4, logprobs=True)
        msg = out.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls or [None]:  # (the random model rarely calls: a user turn)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{10 + i} C"}
                            if call else {"role": "user", "content": f"{10 + i} C"})
    return {"reward": float(len(out.choices[0].logprobs.content)),
            "metrics": {"prompt_tokens": out.usage.prompt_tokens}}


def edits_history(client, row):
    """The second call rewrites the user's message: a prefix break."""
    first = [{"role": "user", "content": row["prompt"]}]
    out = client.chat.completions.create(model="policy", messages=first, max_tokens=4)
    edited = [{"role": "user", "content": "Edited: " + row["prompt"]},
              {"role": "assistant", "content": out.choices[0].message.content},
              {"role": "user", "content": "and?"}]
    client.chat.completions.create(model="policy", messages=edited, max_tokens=4)
    return 0.5


def no_model(client, row):
    return 0.25


def fifty_calls(client, row):
    """50 completion calls of one token each, the text growing by each: one sequence."""
    text = row["prompt"]
    for _ in range(50):
        out = client.completions.create(model="policy", prompt=text, max_tokens=1)
        text += out.choices[0].text
    return 1.0


def two_choices(client, row):
    out = client.chat.completions.create(model="policy", n=2, max_tokens=3,
                                         messages=[{"role": "user", "content": row["prompt"]}])
    return float(len(out.choices))


def stops(client, row):
    """Stop strings: the text comes back cut before them; sent back, the call is spliced
    onto the engine's tokens (the stop string's included)."""
    stop = [" ", "e", "a", "o"]
    out = client.completions.create(model="policy", prompt="hello", max_tokens=8, stop=stop)
    text = out.choices[0].text
    client.completions.create(model="policy", prompt="hello" + text + "!", max_tokens=2)
    return {"reward": float(not any(s in text for s in stop)),
            "metrics": {"stopped": float(out.choices[0].finish_reason == "stop")}}


async def async_agent(client, row):
    out = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=3)
    return 0.75 if out.choices[0].message.role == "assistant" else 0.0


async def sdk_agent(client, row):
    """The OpenAI Agents SDK (openai-agents) on the gateway: its chat-completions model with
    the episode's client, a function tool, the SDK's own run loop."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # (it would export traces to OpenAI)

    @function_tool
    def temperature(city: str) -> str:
        """The temperature in a city."""
        return "4 C"

    agent = Agent(name="weather", instructions="Be brief.", tools=[temperature],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
                  model_settings=ModelSettings(max_tokens=4))
    result = await Runner.run(agent, "Oslo?", max_turns=3)
    return 1.0 if isinstance(result.final_output, str) else 0.0


def hangs(client, row):
    time.sleep(3600)


def raises(client, row):
    raise KeyError("no such city")


def not_a_number(client, row):
    return "sunny"


def exits(client, row):
    os._exit(3)


def malformed(client, row):
    """Bad requests, raw over HTTP: each status in the metrics."""
    url, key = str(client.base_url).rstrip("/"), client.api_key
    auth = {"Authorization": f"Bearer {key}"}
    ok_msgs = [{"role": "user", "content": "hi"}]
    with httpx.Client(trust_env=False, timeout=30) as http:
        def post(path, body, headers=auth, raw=None):
            r = http.post(url + path, headers={**headers, "Content-Type": "application/json"},
                          content=raw if raw is not None else json.dumps(body))
            assert "error" in r.json() and "message" in r.json()["error"], r.text
            return r.status_code
        statuses = {
            "bad_json": post("/chat/completions", None, raw=b"{not json"),
            "unknown_model": post("/chat/completions", {"model": "gpt-9", "messages": ok_msgs}),
            "bad_schema": post("/chat/completions", {
                "model": "policy", "messages": ok_msgs, "tools": [{"type": "function",
                "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}),
            "no_token": post("/chat/completions", {"model": "policy", "messages": ok_msgs},
                             headers={}),
            "wrong_token": post("/completions", {"model": "policy", "prompt": "x"},
                                headers={"Authorization": "Bearer sk-wrong"}),
            "temperature": post("/completions", {"model": "policy", "prompt": "x",
                                                 "temperature": 0.3}),
            "stream": post("/completions", {"model": "policy", "prompt": "x", "stream": "yes"}),
            "unknown_route": http.get(url + "/nope", headers=auth).status_code,
        }
        models = http.get(url + "/models", headers=auth).json()
    # the real client raises its own errors with the gateway's message
    try:
        client.chat.completions.create(model="gpt-9", messages=ok_msgs)
    except openai.NotFoundError as e:
        statuses["client_not_found"] = e.status_code
    return {"reward": 1.0 if models["data"][0]["id"] == "policy" else 0.0,
            "metrics": {f"status_{k}": float(v) for k, v in statuses.items()}}


def null_content(client, row):
    """A history as most frameworks send it: a few-shot example's assistant turn with
    `"content": null` beside its tool call, and each reply appended as the SDK returns it
    (model_dump() without exclude_none: its null fields included). The first call renders the
    example through the template (nothing to splice); the second is spliced onto it. (Short:
    the test engine's context is 128 characters.)"""
    call = {"id": "e", "type": "function", "function": {"name": "t", "arguments": "{}"}}
    messages = [{"role": "user", "content": "R?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "user", "content": "?"}]
    for _ in range(2):
        out = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        messages.append(out.choices[0].message.model_dump())
        messages.append({"role": "user", "content": "?"})
    return 1.0


def generate_tokens(client, row):
    """vLLM's token-in / token-out endpoint, raw over HTTP (what verifiers v1 speaks): a prompt
    of ids, then the prompt + the ids sampled + new ids (one trained sequence); and two bad
    requests, their statuses and params returned as metrics."""
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    auth = {"Authorization": f"Bearer {client.api_key}"}
    with httpx.Client(trust_env=False, timeout=30) as http:
        def generate(ids, **params):
            body = {"token_ids": ids, "model": "policy",
                    "sampling_params": {"max_tokens": 4, "logprobs": 0, **params}}
            return http.post(root + "/inference/v1/generate", headers=auth, json=body)
        first = generate([5, 6, 7]).json()["choices"][0]
        ids = [5, 6, 7] + first["token_ids"] + [8, 9]
        second = generate(ids).json()
        bad_p = generate([5], top_p=0.5)
        bad_id = generate([5, 10**6])
        streamed = []  # continued, streamed (vLLM's chunks): the ids come back
        third = ids + second["choices"][0]["token_ids"] + [7]
        with http.stream("POST", root + "/inference/v1/generate", headers=auth, json={
                "token_ids": third, "stream": True, "stream_options": {"include_usage": True},
                "sampling_params": {"max_tokens": 3, "logprobs": 0}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line.removeprefix("data: ")))
    stream_ok = (len(streamed) == 2 and streamed[-1]["usage"]["completion_tokens"]
                 == len(streamed[0]["choices"][0]["token_ids"]) >= 1
                 and streamed[0]["choices"][0]["finish_reason"] in ("stop", "length"))
    lps = [x["logprob"] for x in first["logprobs"]["content"]]
    ok = (len(lps) == len(first["token_ids"]) == first["weight_versions"][0]["end"]
          and second["usage"]["prompt_tokens"] == len(ids) and stream_ok)
    return {"reward": float(ok), "metrics": {
        "bad_top_p": float(bad_p.status_code), "bad_id": float(bad_id.status_code),
        "bad_top_p_named": float(bad_p.json()["error"]["param"] == "sampling_params.top_p"),
        "bad_id_named": float(bad_id.json()["error"]["param"] == "token_ids")}}


def streams(client, row):
    """stream=True with the openai SDK: a chat call with tools, logprobs and the usage chunk,
    its deltas assembled as the SDK's users do and sent back (spliced: one sequence); and a
    completion stream."""
    messages = [{"role": "user", "content": row["prompt"]}]
    stream = client.chat.completions.create(
        model="policy", messages=messages, tools=WEATHER, max_tokens=4, logprobs=True,
        stream=True, stream_options={"include_usage": True})
    content, finish, usage, tokens = "", None, None, 0
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            tokens += len(c.logprobs.content) if c.logprobs and c.logprobs.content else 0
    messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "?"}]
    text = ""
    for chunk in client.chat.completions.create(model="policy", messages=messages,
                                                tools=WEATHER, max_tokens=4, stream=True):
        text += "".join(c.delta.content or "" for c in chunk.choices)
    ok = finish in ("stop", "length") and usage.completion_tokens == tokens >= 1
    return {"reward": float(ok), "metrics": {"streamed_tokens": float(tokens)}}


def stream_dropped(client, row):
    """A client that reads one event of a stream and drops it: only its own request ends;
    the next call is answered as usual."""
    url, auth = str(client.base_url).rstrip("/"), {"Authorization": f"Bearer {client.api_key}"}
    with httpx.Client(trust_env=False, timeout=30) as http:
        with http.stream("POST", url + "/completions", headers=auth, json={
                "model": "policy", "prompt": "abc", "max_tokens": 6, "stream": True}) as r:
            first = next(r.iter_lines())
    out = client.completions.create(model="policy", prompt="xyz", max_tokens=2)
    return float(first.startswith("data: {") and out.choices[0].finish_reason is not None)


def anthropic_messages(client, row):
    """The `anthropic` SDK on the gateway, unmodified but for its base URL and model name:
    messages.stream with a tool and a system prompt, the final message's blocks sent back
    (spliced: one sequence), then messages.create; a wrong model is its NotFoundError."""
    import anthropic

    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    sdk = anthropic.Anthropic(base_url=root, api_key=client.api_key, max_retries=0)
    tools = [{"name": "temperature", "description": "The temperature in a city, in C.",
              "input_schema": WEATHER[0]["function"]["parameters"]}]
    messages = [{"role": "user", "content": row["prompt"]}]
    with sdk.messages.stream(model="policy", max_tokens=4, system="Be brief.", tools=tools,
                             messages=messages) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    text = "".join(b.text for b in final.content if b.type == "text")
    messages += [{"role": "assistant",
                  "content": [b.model_dump(exclude_none=True) for b in final.content]},
                 {"role": "user", "content": "?"}]
    out = sdk.messages.create(model="policy", max_tokens=4, system="Be brief.", tools=tools,
                              messages=messages)
    try:
        sdk.messages.create(model="claude-9", max_tokens=4, messages=messages)
        not_found = 0.0
    except anthropic.NotFoundError:
        not_found = 1.0
    ok = (streamed == text and final.usage.output_tokens >= 1
          and out.stop_reason in ("end_turn", "max_tokens", "tool_use"))
    return {"reward": float(ok), "metrics": {"not_found": not_found}}


def responses_api(client, row):
    """The Responses API through the openai SDK: a call with instructions and a function
    tool, one continuing it by previous_response_id (spliced onto the first's sampled ids), a
    streamed third; an unknown previous_response_id is the SDK's NotFoundError."""
    tools = [{"type": "function", "name": "temperature", "description": "In C.",
              "parameters": WEATHER[0]["function"]["parameters"]}]
    common = {"model": "policy", "instructions": "Be brief.", "tools": tools,
              "max_output_tokens": 4}
    first = client.responses.create(input=row["prompt"], **common)
    second = client.responses.create(previous_response_id=first.id, input="?", **common)
    with client.responses.stream(previous_response_id=second.id, input="!", **common) as s:
        events = list(s)  # (ends in response.incomplete when max_output_tokens cut the reply,
        # as OpenAI's does: the SDK's get_final_response wants response.completed)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    third = events[-1].response
    try:
        client.responses.create(previous_response_id="resp_nope", input="x", **common)
        not_found = 0.0
    except openai.NotFoundError:
        not_found = 1.0
    ok = (all(r.status in ("completed", "incomplete") for r in (first, second, third))
          and deltas == third.output_text and third.usage.output_tokens >= 1)
    return {"reward": float(ok), "metrics": {"not_found": not_found}}


async def sdk_responses_agent(client, row):
    """The OpenAI Agents SDK with its default model, OpenAIResponsesModel (the Responses API),
    a function tool, its own run loop."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)

    @function_tool
    def temperature(city: str) -> str:
        """The temperature in a city."""
        return "4 C"

    from agents.exceptions import ModelBehaviorError

    agent = Agent(name="weather", instructions="Be brief.", tools=[temperature],
                  model=OpenAIResponsesModel(model="policy", openai_client=client),
                  model_settings=ModelSettings(max_tokens=4))
    try:
        result = await Runner.run(agent, "Oslo?", max_turns=3)
    except ModelBehaviorError as e:  # the SDK read our response and refuses an incomplete
        # one (a random model's reply rarely ends within 4 tokens), as it would OpenAI's
        return 0.5 if "max_output_tokens" in str(e) else 0.0
    return 1.0 if isinstance(result.final_output, str) else 0.0


def forced_tools(client, row):
    """tool_choice a named function, then required: each reply begins with the call the
    gateway wrote into the prompt (hermes), which the random model continues (a call it
    closes is parsed into tool_calls); sent back, the second call is spliced."""
    messages = [{"role": "user", "content": row["prompt"]}]
    named = {"type": "function", "function": {"name": "temperature"}}
    ok = True
    for choice, head in ((named, '<tool_call>\n{"name": "temperature", "arguments": '),
                         ("required", '<tool_call>\n{"name": "')):
        out = client.chat.completions.create(model="policy", messages=messages, tools=WEATHER,
                                             tool_choice=choice, max_tokens=4)
        msg = out.choices[0].message
        ok &= bool(msg.tool_calls) or (msg.content or "").startswith(head)
        messages += [msg.model_dump(exclude_none=True),
                     {"role": "user", "content": "?"}]
    return float(ok)


def all_refused(client, row):
    """Every request refused (a temperature the gateway does not serve), caught as agents
    catch a BadRequestError: episodes that sample nothing, no agent error."""
    try:
        client.chat.completions.create(model="policy", temperature=0.3,
                                       messages=[{"role": "user", "content": "hi"}])
    except openai.BadRequestError:
        pass
    return 0.0


AGENTS = {f.__name__: f for f in (chat_tools, edits_history, no_model, fifty_calls,
                                  two_choices, hangs, raises, not_a_number, exits, malformed,
                                  stops, null_content, generate_tokens, streams,
                                  stream_dropped, anthropic_messages, responses_api,
                                  forced_tools)}


def scenario(client, row):
    return AGENTS[row["kind"]](client, row)
