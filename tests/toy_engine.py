"""A toy target engine for tests/test_engine_registry.py: a fixed random bigram table as the "model".

It implements decoder/engine.py's protocol and nothing else: every logit row is the table's row of its
own input token, so trees, chains and plain decoding agree by construction, and a forward's time grows
with its input (one [n, V] gather plus a small matmul per row). Registered by the test, never by the
project: an engine is one module like this plus one `register(EngineKind(...))`.
"""
from __future__ import annotations

import time

import torch

from decoder.engine import Scored

V = 96  # vocabulary: the tokenizer maps bytes to it


class ToyTokenizer:
    chat_template = "toy"  # workflows.cli.inputs.encode_prompts applies it

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = " ".join(m["content"] for m in messages)
        return [1] + [b % (V - 2) + 2 for b in text.encode()][:48] + [1]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + i % 90) for i in ids)


class ToyEngine:
    def __init__(self, caps, seed: int = 0):
        self.caps, self.model_name, self.vocab_size = caps, "toy-bigram", V
        self.device, self.dtype, self.max_positions, self.tokenizer = torch.device("cpu"), torch.float32, 4096, ToyTokenizer()
        self.table = torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 3  # [V, V]: next-token logits
        self.mix = torch.randn(V, V, generator=torch.Generator().manual_seed(seed + 1)) / V  # the "compute" per row

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.table[tokens.reshape(-1)]  # [n, V]
        return rows + 0.0 * (rows @ self.mix)  # the matmul costs time with n; it changes nothing

    def eos_ids(self) -> set[int]:
        return {0}

    def record(self) -> dict:
        return {"engine": self.caps.name, "model": self.model_name, "model_source": "test", "has_weights": True,
                "dtype": "fp32", "device": "cpu", "threads": None}

    def versions(self) -> dict:
        return {"torch": torch.__version__}

    def start(self, prompt_ids, hidden=False, pad_to=None):
        ids = torch.as_tensor(prompt_ids).reshape(-1)
        return ToySequence(self, ids.numel() - 1, ids[-1:].clone()), None

    def check_room(self, seq, max_new_tokens, step_input):
        pass

    def teacher_forced(self, ids, hidden=False):
        return Scored(self.logits(torch.as_tensor(ids)), None)

    def stock_generate(self, prompt_ids, max_new_tokens, sampling=None, seed=0):
        t0, out, tok = time.perf_counter(), [], int(torch.as_tensor(prompt_ids).reshape(-1)[-1])
        while len(out) < max_new_tokens and (not out or out[-1] != 0):
            tok = int(self.logits(torch.tensor([tok]))[0].argmax())
            out.append(tok)
        return out, time.perf_counter() - t0

    def check_lengths(self, input_lengths, context_length, batch_size=1):
        pass

    def forward_timer(self, spec):
        return ToyTimer(self)

    def reserve(self, tokens):
        pass

    def close(self):
        pass


class ToySequence:
    def __init__(self, engine: ToyEngine, context_length: int, root: torch.Tensor):
        self.engine, self.context_length, self.root = engine, context_length, root

    def score(self, step):
        return Scored(self.engine.logits(step.tokens), None)

    def commit(self, verdict):
        self.context_length += len(verdict.nodes)
        self.root = verdict.root.reshape(1)

    def rollback(self, length):
        self.context_length = min(self.context_length, length)


class ToyTimer:
    description = "n tokens, each row its token's table row"

    def __init__(self, engine: ToyEngine):
        self.engine = engine

    def warm(self, n, times=1):
        for _ in range(times):
            self.sample(n)()

    def sample(self, n):
        tokens = torch.arange(n) % V
        return lambda: self.engine.logits(tokens)

    def drop(self, n):
        pass

    def close(self):
        pass


def open_engine(request):
    from planner.engines import kind

    return ToyEngine(kind("toy").caps)
