"""vLLM as a target engine: its environment (env.py) and its OpenAI-compatible server (server.py)."""
