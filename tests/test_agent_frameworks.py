"""Agent frameworks on the gateway, each unmodified apart from its base URL and model name
(tests/framework_agents.py): LangGraph's ReAct agent streaming with stream_mode="messages",
and smolagents' ToolCallingAgent with stream_outputs=True (tool_choice required). The Agents
SDK (both models), the openai SDK streaming and the anthropic SDK: tests/test_agent_gateway.py.
A tiny random model, so the loops run but do not solve anything: learning with them is
bench/ work (docs/agents.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def frameworks(tmp_path_factory):
    import torch
    from conftest import DIST, ROOT, child_env
    from test_multi_turn import chat_tokenizer
    from transformers import Qwen2ForCausalLM

    from llamarl.tiny.model import build_config, save_hf_dir

    pytest.importorskip("langgraph")
    pytest.importorskip("smolagents")
    tok = chat_tokenizer()
    config = build_config(len(tok))
    config.eos_token_id = tok.eos_token_id
    config.max_position_embeddings = 4096  # (the frameworks' prompts are long)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    path = tmp_path_factory.mktemp("chat") / "model"
    save_hf_dir(path, model.state_dict(), model.config, tok)
    proc = subprocess.run([sys.executable, str(DIST / "agent_frameworks.py"), str(path)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("agent", ["langgraph_agent", "smolagents_agent"])
def test_a_framework_agent_runs_its_loop_through_the_gateway(frameworks, agent):
    got = frameworks[agent]
    assert got.get("rewards") == [1.0, 1.0], got
    m = got["metrics"]
    assert m["agent_errors"] == 0 and m["model_calls"] >= 2, m
    assert m["refused_calls"] == 0 and not any(k.startswith("gateway_4xx/") for k in m), m
    assert all(t >= 1 for t in got["turns"]), got
