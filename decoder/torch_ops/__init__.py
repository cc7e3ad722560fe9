"""Torch helpers for transformers models, shared by the hf engine and by the drafters that run their own
small models (a draft LM, EAGLE and ParallelSpec heads): the KV-cache keyword, prefill, the tree
forward with its 4D mask, and KV-cache crop and compaction. Neither engine-specific nor guesser-specific:
the hf engine (decoder/engines/hf) and the guessers (decoder/guessers) both import it, never each other."""
