"""Agent frameworks on the gateway, each unmodified apart from its base URL and model name
(tests/framework_agents.py): LangGraph's ReAct agent streaming with stream_mode="messages",
and smolagents' ToolCallingAgent with stream_outputs=True (tool_choice required). The Agents
SDK (both models), the openai SDK streaming and the anthropic SDK: tests/test_agent_gateway.py.
A tiny random model, so the loops run but do not solve anything: learning with them is
bench/ work (docs/agents.md)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def frameworks(tmp_path_factory):
    from test_agent_gateway import run_on_chat_model

    pytest.importorskip("langgraph")
    pytest.importorskip("smolagents")
    # (4096 positions: the frameworks' prompts are long)
    return run_on_chat_model("agent_frameworks.py", tmp_path_factory.mktemp("chat") / "model",
                             positions=4096)


@pytest.mark.parametrize("agent", ["langgraph_agent", "smolagents_agent"])
def test_a_framework_agent_runs_its_loop_through_the_gateway(frameworks, agent):
    got = frameworks[agent]
    assert got.get("rewards") == [1.0, 1.0], got
    m = got["metrics"]
    assert m["agent_errors"] == 0 and m["model_calls"] >= 2, m
    assert m["refused_calls"] == 0 and not any(k.startswith("gateway_4xx/") for k in m), m
    assert all(t >= 1 for t in got["turns"]), got
