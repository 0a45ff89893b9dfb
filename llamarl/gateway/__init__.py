"""The engine rank's OpenAI-compatible gateway (docs/agents.md): HTTP in a thread of the
generator process (server.py), requests checked there (requests.py) and served by the
generator's loop (rollout/agent_source.py), which records every call's tokens exactly
(rollout/capture.py). Nothing here imports rollout/: the gateway only speaks HTTP."""
