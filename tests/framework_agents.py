"""Agents written with agent frameworks, pointed at the gateway unmodified apart from the
base URL and the model name (tests/test_agent_frameworks.py, tests/dist/agent_frameworks.py).
Each returns 1.0 when the framework's own loop ran to its end."""

from __future__ import annotations


def langgraph_agent(client, row):
    """LangGraph's prebuilt ReAct agent on langchain-openai's ChatOpenAI, a tool, streamed
    with stream_mode="messages" (token chunks through the chat endpoint's SSE)."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def temperature(city: str) -> str:
        """The temperature in a city, in C."""
        return "4 C"

    llm = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key,
                     max_tokens=8, max_retries=0)
    agent = create_react_agent(llm, [temperature])
    chunks = 0
    for _message, _meta in agent.stream({"messages": [("user", row["prompt"])]},
                                        stream_mode="messages",
                                        config={"recursion_limit": 6}):
        chunks += 1
    return {"reward": 1.0, "metrics": {"chunks": float(chunks)}}


SMOLAGENTS_SYSTEM_PROMPT = "Answer with a tool call. Tools: {%- for tool in tools.values() %} \
{{ tool.name }}{%- endfor %}."


def smolagents_agent(client, row):
    """smolagents' ToolCallingAgent on its OpenAIServerModel with stream_outputs=True (its
    tool_choice is "required"). Its default system prompt (~2.5k tokens) does not fit the
    test model's context: overridden here (SMOLAGENTS_SYSTEM_PROMPT); docs/agents.md."""
    import importlib.resources

    import yaml
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def temperature(city: str) -> str:
        """The temperature in a city, in C.

        Args:
            city: the city's name
        """
        return "4 C"

    templates = yaml.safe_load(importlib.resources.files("smolagents.prompts")
                               .joinpath("toolcalling_agent.yaml").read_text())
    templates["system_prompt"] = SMOLAGENTS_SYSTEM_PROMPT
    model = OpenAIServerModel(model_id="policy", api_base=str(client.base_url),
                              api_key=client.api_key, max_tokens=8,
                              client_kwargs={"max_retries": 0})
    agent = ToolCallingAgent(tools=[temperature], model=model, prompt_templates=templates,
                             stream_outputs=True, max_steps=2, verbosity_level=0)
    agent.run(row["prompt"])
    return {"reward": 1.0, "metrics": {"steps": float(len(agent.memory.steps))}}
