"""The built-in multi-turn environments (rollout.env) and agents (rollout.agent), by the short
names a recipe may use; anything else is named "module:Class" / "module:function".

    lookup      the tiny tool task (llamarl/tiny/lookup.py), compact tool calls
    calculator  GSM8K with a calculator tool, for chat models (Hermes tool calls)
    multiply    products of a 3-digit and a 2-digit number with a calculator tool, for a
                small chat model (SmolLM2-135M-Instruct, Hermes tool calls)
"""

BUILTIN_ENVS = {"lookup": "llamarl.envs.lookup:LookupEnv",
                "calculator": "llamarl.envs.calculator:CalculatorEnv",
                "multiply": "llamarl.envs.multiply:MultiplyEnv"}
BUILTIN_AGENTS = {"lookup": "llamarl.envs.lookup_agent:lookup_agent",
                  "multiply": "llamarl.envs.multiply_agent:multiply_agent"}
