"""Serving engines' side runs for the exports (vLLM in its own environment, docs/vllm.md)."""
