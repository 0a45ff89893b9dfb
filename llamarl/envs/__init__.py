"""Built-in multi-turn environments (rollout.env): lookup (the tiny tool task) and calculator
(GSM8K with a calculator tool, for chat models)."""
