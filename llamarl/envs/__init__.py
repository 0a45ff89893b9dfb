"""Built-in multi-turn environments (rollout.env) and agents (rollout.agent); their short names
are listed in llamarl/registry/envs.py."""
