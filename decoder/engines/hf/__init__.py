"""The Hugging Face engine: any transformers causal LM (docs/layout.md)."""
