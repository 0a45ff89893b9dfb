"""The engine rank's OpenAI-compatible gateway (docs/agents.md): HTTP in a thread of the
generator process (server.py), requests checked there (requests.py) and served by the
generator's loop, which records every call's tokens exactly (capture.py)."""
