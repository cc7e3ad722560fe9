"""llama.cpp's own decoding through llama-cpp-python's high-level `Llama`: the baselines a plan in the
llama.cpp engine is compared with, and the reference its greedy output must equal.

    stock = StockLlama(gguf, threads=2)                  # plain greedy decoding (Llama.generate, top-k 1)
    tokens, seconds = stock.greedy(prompt_ids, 96)
    lookup = StockLlama(gguf, threads=2, lookup=4)       # its LlamaPromptLookupDecoding(num_pred_tokens=4)
    tokens, seconds = stock.sample(prompt_ids, 96, Sampling(0.7, 0, 0.9), seed=3)   # its own sampler chain

Sampling: llama.cpp's chain as llama-cpp-python builds it is top-k, typical, top-p, min-p, then temperature
(min-p and typical off here), where transformers (and this project's loop) apply temperature first, then
top-k, then top-p: with top-p < 1 and a temperature other than 1 the kept set differs, so this sampler's
distribution is not the loop's; it is a speed reference, not a distribution one.

Same build, same context settings as decoder/engines/llama_cpp/engine.py (flash attention off, the same threads),
the prompt fed as token ids. Every call re-evaluates the prompt: `Llama.generate` would otherwise
reuse the KV cache of an earlier identical prompt, which no other contender gets.
"""
from __future__ import annotations

import time
from pathlib import Path

from decoder.engines.llama_cpp.lib import _backend, check_threads, llama_lib
from planner.errors import UserError

MAX_LOOKUP = 64


class StockLlama:
    def __init__(self, gguf_path, threads: int | None = None, n_ctx: int = 4096, lookup: int | None = None):
        lib = llama_lib()
        _backend(lib)
        if not Path(gguf_path).is_file():
            raise UserError(f"{gguf_path}: GGUF file not found")
        if lookup is not None and not 1 <= lookup <= MAX_LOOKUP:
            raise UserError(f"llama.cpp prompt lookup: num_pred_tokens must be in 1..{MAX_LOOKUP}, got {lookup}")
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.threads = check_threads(threads)
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
        self.llm = Llama(str(gguf_path), n_ctx=n_ctx, n_threads=self.threads, n_threads_batch=self.threads,
                         n_gpu_layers=0, draft_model=draft, verbose=False)
        self.lookup = lookup
        self.n_ctx = self.llm.n_ctx()
        self.name = "llama.cpp plain" if lookup is None else f"llama.cpp lookup {lookup}"
        vocab = self.llm._model.vocab
        self.eos = {i for i in (lib.llama_vocab_eos(vocab), lib.llama_vocab_eot(vocab)) if i >= 0}

    def greedy(self, prompt_ids, max_new_tokens: int) -> tuple[list[int], float]:
        """Greedy tokens (up to and including EOS, as the decoding loop keeps it) and the wall time from the
        call to the last token, prefill included."""
        return self._generate(prompt_ids, max_new_tokens, top_k=1, top_p=1.0, temp=0.0)

    def sample(self, prompt_ids, max_new_tokens: int, s, seed: int) -> tuple[list[int], float]:
        """As greedy, sampled by llama.cpp's own chain with s's temperature, top-k (0: off) and top-p
        (a planner.sampling.Sampling; greedy at temperature 0) and this seed."""
        if s.temperature <= 0:
            return self.greedy(prompt_ids, max_new_tokens)
        self.llm.set_seed(seed)  # read when generate builds its sampler
        return self._generate(prompt_ids, max_new_tokens, top_k=s.top_k, top_p=s.top_p, temp=s.temperature)

    def _generate(self, prompt_ids, max_new_tokens: int, **warp) -> tuple[list[int], float]:
        ids = [int(t) for t in prompt_ids]
        if len(ids) + max_new_tokens + (self.lookup or 0) + 1 > self.llm.n_ctx():
            raise UserError(f"prompt ({len(ids)}) + max_new_tokens ({max_new_tokens}) exceed n_ctx {self.llm.n_ctx()}")
        self.llm.reset()  # no KV reuse from an earlier call
        out: list[int] = []
        t0 = time.perf_counter()
        if max_new_tokens > 0:
            for t in self.llm.generate(ids, min_p=0.0, typical_p=1.0, repeat_penalty=1.0, reset=True, **warp):
                out.append(int(t))
                if t in self.eos or len(out) == max_new_tokens:
                    break
        return out, time.perf_counter() - t0

    def close(self) -> None:
        self.llm.close()
