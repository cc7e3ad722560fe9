"""llama.cpp as the target engine: a GGUF file through llama-cpp-python's low-level API.

    engine = LlamaEngine("SmolLM2-135M-Instruct.Q4_1.gguf")        # threads: the machine's cores
    seq, _ = engine.start(prompt_ids)                                # prefill all but the last token
    scored = seq.score(StepInput(tokens, layout))                    # logits [num_tree, V], layout order
    seq.commit(verdict)                                              # keep root + accepted path

One llama.cpp context holds one sequence at a time (`start` clears it). A step's tree goes into one
`llama_decode` batch the way llama.cpp's own tree drafting does it: one sequence id per root-to-leaf
path, a token shared by every path through it carrying all their ids, so each token sees the context
and its own ancestors only (llama.cpp masks by sequence id and position). Every tree token returns
its logits (greedy and lossless verification read the parent of every candidate and the last
accepted node). Commit keeps the accepted path's sequence and drops the other paths' cells; a chain
(one path) needs only a cut of its tail.

Exactness. With the llamafile matmul path off (scripts/setup.sh builds so), llama.cpp computes every
row of a batched matmul exactly as a one-token evaluation. Its CPU attention (flash attention off, as
llama-cpp-python's `Llama`) sums over KV cells in SIMD lanes and 8-cell chunks by cell index, so a
token's logits equal one-token decoding's bit for bit only when its visible cells sit where a
one-token loop puts them: position p in cell p. A chain's tokens land exactly there (the context, then
the chain in order; a cut tail frees the cells right after the kept ones, which the next step fills),
so chain steps are bit-identical to plain decoding (tests/test_llama_engine.py checks every row). In a
tree only one path can own cells C..C+d; a token of another path sits elsewhere, its sums round
differently (order 1e-7), and llama.cpp's 8-bit quantisation of activations before each matmul turns
that into logit differences of about 0.3 (measured), which flips greedy choices at near ties (seen
within 32 tokens). So the engine scores one chain per step (caps.trees False) unless built with
trees=True, where a tree is laid out depth-first with the rank-0 chain first: that path stays
bit-identical and the others are approximate (for experiments, not for exact decoding).
With the llamafile path on (the default build) even chains round differently from one-token
evaluation: `llamafile_build()` detects it and the engine says so once.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from decoder.engine import Scored, StepInput
from decoder.engines.llama_cpp.lib import _backend, _warn_llamafile, build_info, check_threads, llama_lib
from planner.errors import UserError

MAX_PATHS = 256  # llama.cpp's LLAMA_MAX_SEQ: sequence ids per context
CTX_RANGE = (256, 131072)
# the stock Llama's smallest context: what a user's own Llama would open (its per-token cost follows the
# cells in use, not the context's size), so it is opened once and not reloaded as prompts grow
STOCK_MIN_CTX = 2048


# ---------------------------------------------------------------------------------------------- a step's batch shape


@dataclass(frozen=True)
class BatchShape:
    """Where a step layout's tokens go in a llama.cpp batch, built once per layout.

    Batch order is depth-first with children in rank order, so the rank-0 chain comes first and
    lands in the cells a one-token loop would use. Path p (sequence id p) is the p-th leaf in that
    order, root to leaf."""

    order: tuple[int, ...]  # batch index -> layout index
    depth: tuple[int, ...]  # per batch index: position offset after the context
    seqs: tuple[tuple[int, ...], ...]  # per batch index: the paths (sequence ids) through the token
    path_of: tuple[int, ...]  # per layout index: a path through it (the first)
    n_paths: int
    identity: bool  # order is the layout's own (logits need no reordering)
    inverse: tuple[int, ...]  # layout index -> batch index (the logits' rows in layout order)


def batch_shape(children: list[list[int]]) -> BatchShape:
    """children[u]: tree indices of u's children in rank order (root 0)."""
    order, depth, stack = [], {0: 0}, [0]
    while stack:
        u = stack.pop()
        order.append(u)
        for c in reversed(children[u]):
            depth[c] = depth[u] + 1
            stack.append(c)
    leaves = [u for u in order if not children[u]]
    through: dict[int, list[int]] = {u: [] for u in order}
    parent = {c: u for u in order for c in children[u]}
    for p, leaf in enumerate(leaves):
        u = leaf
        while True:
            through[u].append(p)
            if u == 0:
                break
            u = parent[u]
    path_of = [0] * len(order)
    for u in order:
        path_of[u] = through[u][0]
    return BatchShape(tuple(order), tuple(depth[u] for u in order), tuple(tuple(through[u]) for u in order),
                      tuple(path_of), len(leaves), order == sorted(order), tuple(int(i) for i in np.argsort(order)))


def layout_children(layout) -> list[list[int]]:
    """A StepLayout's children lists (its [num_tree, max_children] table, -1 padded)."""
    rows = layout.children.tolist()
    return [[c for c in row if c >= 0] for row in rows[: layout.num_tree]] + [[] for _ in range(layout.num_tree - len(rows))]


def chain_shape(n: int) -> BatchShape:
    return BatchShape(tuple(range(n)), tuple(range(n)), ((0,),) * n, (0,) * n, 1, True, tuple(range(n)))


def binary_tree_shape(n: int) -> BatchShape:
    """The profiler's stand-in tree: node i under node (i - 1) // 2."""
    kids: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        kids[(i - 1) // 2].append(i)
    return batch_shape(kids)


# ---------------------------------------------------------------------------------------------- the engine


class LlamaEngine:
    """A GGUF model in one llama.cpp context (CPU). threads: llama.cpp's compute threads (default: the
    cores this process may use); n_ctx: KV cells (prompt + answer + the largest step; `reserve` grows
    it); max_paths: most root-to-leaf paths of a step tree (sequence ids); max_step: most tokens in one
    step. tokenizer: the model's chat tokenizer (None: a random-filled preset), from the opener."""

    def __init__(self, gguf_path, threads: int | None = None, n_ctx: int = 4096, max_paths: int = 64,
                 max_step: int = 256, n_batch: int = 512, trees: bool = False, tokenizer=None,
                 record: dict | None = None):
        from dataclasses import replace

        from planner.engines import kind

        lib = llama_lib()
        _backend(lib)
        path = Path(gguf_path)
        if not path.is_file():
            raise UserError(f"{path}: GGUF file not found")
        self.threads = check_threads(threads)
        for name, x, lo, hi in (("n_ctx", n_ctx, *CTX_RANGE), ("max_paths", max_paths, 1, MAX_PATHS),
                                ("max_step", max_step, 1, 4096), ("n_batch", n_batch, 32, 8192)):
            if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
                raise UserError(f"llama.cpp engine: {name} must be an integer in {lo}..{hi}, got {x!r}")
        self.lib, self.path = lib, path
        # torch only verifies on the host here (one-row argmaxes): its thread pool would spin against
        # llama.cpp's and cost milliseconds per step on a busy machine (measured: 18 ms instead of 0.7)
        torch.set_num_threads(1)
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self._model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise UserError(f"{path}: llama.cpp cannot load it as a GGUF model")
        self.n_train = lib.llama_model_n_ctx_train(self._model)
        self.n_batch = max(n_batch, max_step)
        self.max_paths, self.max_step = max_paths, max_step
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = lib.llama_vocab_n_tokens(self._vocab)
        self._ctx = None
        self._new_context(n_ctx)
        self._shapes: dict[int, tuple[object, BatchShape]] = {}
        self._generation = 0  # start() count: a Sequence of an earlier start is stale
        self.caps = replace(kind("llama.cpp").caps, trees=trees, threads=self.threads)
        _warn_llamafile()
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.model_name = path.name
        self.tokenizer = tokenizer
        self._record = record or {"model": path.name, "model_source": "file", "has_weights": True}
        self.max_positions = self.n_train if self.n_train > 0 else None
        self._stock = None  # llama-cpp-python's own Llama on the same file (stock_generate), opened on first use

    def _new_context(self, n_ctx: int) -> None:
        lib = self.lib
        self.n_ctx = min(n_ctx, self.n_train) if self.n_train > 0 else n_ctx
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = self.n_ctx
        cparams.n_batch = cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = self.max_paths
        cparams.kv_unified = True  # one KV buffer: a token may belong to several paths (sequence ids)
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as llama-cpp-python's Llama (plain reference)
        cparams.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise UserError(f"{self.path}: llama.cpp cannot create a context of {self.n_ctx} tokens")
        self._mem = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(self.n_batch, 0, self.max_paths)

    def reserve(self, tokens: int) -> None:
        """Room for sequences of up to `tokens` tokens: a context that is too small is replaced by one of the
        next multiple of 256 cells (a bigger context than a run needs makes every step slower: its
        attention and KV bookkeeping scale with the cells)."""
        if tokens <= self.n_ctx:
            return
        if not tokens <= CTX_RANGE[1]:
            raise UserError(f"llama.cpp engine: {tokens} tokens exceed its largest context ({CTX_RANGE[1]})")
        self.lib.llama_batch_free(self._batch)
        self.lib.llama_free(self._ctx)
        self._generation += 1  # any open sequence is gone with the old context
        self._shapes.clear()
        self._new_context(-(-tokens // 256) * 256)

    def close(self) -> None:
        if getattr(self, "_stock", None) is not None:
            self._stock.close()
            self._stock = None
        if getattr(self, "_ctx", None):
            self.lib.llama_batch_free(self._batch)
            self.lib.llama_free(self._ctx)
            self.lib.llama_model_free(self._model)
            self._ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown: the library may be gone)
            pass

    def describe(self) -> dict:
        return {"engine": "llama.cpp", "model_file": str(self.path), "threads": self.threads, "n_ctx": self.n_ctx,
                **build_info()}

    def record(self) -> dict:
        """What files record about the target: the model and its file, the build, the context and threads."""
        return {"engine": self.caps.name, **self._record, "model_file": str(self.path), "dtype": "gguf",
                "device": "cpu", "threads": self.threads, "llama_cpp": self.describe()}

    def versions(self) -> dict:
        return {"llama_cpp_python": build_info()["llama_cpp_python"]}

    def check_lengths(self, input_lengths: list[int], context_length: int, batch_size: int = 1) -> None:
        if batch_size != 1:
            raise UserError("--batch-sizes: the llama.cpp engine profiles batch size 1 only (one sequence per context)")
        if max(input_lengths) > self.max_step:
            raise UserError(f"--input-lengths: at most {self.max_step} tokens per llama.cpp step, got {max(input_lengths)}")
        self.reserve(context_length + max(input_lengths) + 1)

    def stock_generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, sampling=None, seed: int = 0):
        """llama-cpp-python's own `Llama.generate` on the same file and threads (greedy, or sampled by
        llama.cpp's own chain with the same temperature, top-k and top-p and this seed): a plain decision
        runs it. Its Llama has a context of its own, opened once at a user's size (STOCK_MIN_CTX) and grown
        only for a longer sequence: the step context above is sized small for the steps' sake, and tying
        the two reloaded the model whenever a longer prompt came."""
        ids = [int(t) for t in torch.as_tensor(prompt_ids).reshape(-1).tolist()]
        stock = self.stock(len(ids) + max_new_tokens + 1)
        if sampling is None or sampling.temperature <= 0:
            return stock.greedy(ids, max_new_tokens)
        return stock.sample(ids, max_new_tokens, sampling, seed)

    def stock(self, tokens: int = 0):
        """The StockLlama behind stock_generate, with room for `tokens` (opened, or reopened larger, here)."""
        from decoder.engines.llama_cpp.stock import StockLlama

        if not tokens <= CTX_RANGE[1]:
            raise UserError(f"llama.cpp engine: {tokens} tokens exceed its largest context ({CTX_RANGE[1]})")
        if self._stock is not None and tokens <= self._stock.n_ctx:
            return self._stock
        n_ctx = max(STOCK_MIN_CTX, -(-tokens // 256) * 256)
        if self.n_train > 0:
            n_ctx = min(n_ctx, max(self.n_train, tokens))  # past the trained length only when asked to
        if self._stock is not None:
            self._stock.close()
            self._stock = None
        self._stock = StockLlama(self.path, threads=self.threads, n_ctx=n_ctx)
        return self._stock

    def eos_ids(self) -> set[int]:
        ids = {self.lib.llama_vocab_eos(self._vocab), self.lib.llama_vocab_eot(self._vocab)}
        return {int(i) for i in ids if i >= 0}

    # --------------------------------------------------------------------------------------- KV memory

    def clear(self) -> None:
        self.lib.llama_memory_clear(self._mem, False)

    def keep(self, length: int) -> None:
        """Only sequence 0's first `length` positions stay (every path's cells and ids go)."""
        self.lib.llama_memory_seq_keep(self._mem, 0)
        self.lib.llama_memory_seq_rm(self._mem, 0, length, -1)

    def prefill(self, ids: list[int]) -> None:
        """Tokens 0..len-1 into sequence 0, no logits, in chunks of n_batch."""
        b = self._batch
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start: start + self.n_batch]
            for i, t in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, start + i, 1, 0
                b.seq_id[i][0] = 0
            b.n_tokens = len(chunk)
            self._decode(len(chunk))

    def _decode(self, n: int) -> None:
        rc = self.lib.llama_decode(self._ctx, self._batch)
        if rc != 0:
            raise UserError(f"llama.cpp: llama_decode of {n} tokens failed (code {rc}: "
                            f"{'no free KV cells, raise n_ctx' if rc == 1 else 'see llama.cpp'})")

    def shape_of(self, layout) -> BatchShape:
        """The batch shape of a step layout, built once (layouts are memoised, so ids are stable)."""
        hit = self._shapes.get(id(layout))
        if hit is not None and hit[0] is layout:
            return hit[1]
        shape = chain_shape(layout.num_tree) if layout.depth == layout.num_tree - 1 else batch_shape(layout_children(layout))
        if len(self._shapes) > 512:
            self._shapes.clear()
        self._shapes[id(layout)] = (layout, shape)
        return shape

    def decode_step(self, tokens: list[int], shape: BatchShape, context_length: int) -> np.ndarray:
        """One forward of a step's tokens (layout order) after `context_length` cells of sequence 0.
        Returns logits [n, V] in batch order: a view of llama.cpp's buffer, valid until the next decode."""
        n = len(tokens)
        if n > self.max_step or shape.n_paths > self.max_paths:
            raise UserError(f"llama.cpp engine: a step of {n} tokens over {shape.n_paths} paths exceeds "
                            f"max_step {self.max_step} / max_paths {self.max_paths}")
        if context_length + n > self.n_ctx:
            raise UserError(f"llama.cpp engine: {context_length} + {n} tokens exceed n_ctx {self.n_ctx}")
        lib, b = self.lib, self._batch
        for s in range(1, shape.n_paths):  # every path sees the context
            lib.llama_memory_seq_cp(self._mem, 0, s, -1, -1)
        for i, u in enumerate(shape.order):
            b.token[i], b.pos[i], b.logits[i] = tokens[u], context_length + shape.depth[i], 1
            seqs = shape.seqs[i]
            b.n_seq_id[i] = len(seqs)
            row = b.seq_id[i]
            for j, s in enumerate(seqs):
                row[j] = s
        b.n_tokens = n
        self._decode(n)
        return np.ctypeslib.as_array(lib.llama_get_logits(self._ctx), shape=(n, self.vocab_size))

    def keep_path(self, shape: BatchShape, last: int, context_length: int, kept: int) -> None:
        """After a step at `context_length`: keep the first `kept` positions of the path through layout
        index `last` (root + accepted nodes) in sequence 0, drop every other cell of the step."""
        lib, mem = self.lib, self._mem
        end = context_length + kept
        if shape.n_paths == 1:
            lib.llama_memory_seq_rm(mem, 0, end, -1)
            return
        p = shape.path_of[last]
        lib.llama_memory_seq_keep(mem, p)
        lib.llama_memory_seq_rm(mem, p, end, -1)
        if p != 0:
            lib.llama_memory_seq_cp(mem, p, 0, -1, -1)
            lib.llama_memory_seq_rm(mem, p, -1, -1)

    # --------------------------------------------------------------------------------------- the protocol

    def start(self, prompt_ids: torch.Tensor, hidden: bool = False,
              pad_to: dict[int, int] | None = None) -> tuple[LlamaSequence, None]:
        """pad_to is ignored: llama.cpp's forward grows with every token (no cheaper longer length)."""
        if hidden:
            raise UserError("--engine llama.cpp: llama.cpp returns no hidden states; use --engine hf for guessers "
                            "that read them")
        ids = [int(t) for t in torch.as_tensor(prompt_ids).reshape(-1).tolist()]
        if not ids:
            raise UserError("input_ids: expected a non-empty token sequence")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(f"input_ids: token {bad[0]} outside the model's vocabulary of {self.vocab_size}")
        self.reserve(len(ids) + 1)
        self._generation += 1
        self.clear()
        self.prefill(ids[:-1])
        return LlamaSequence(self, len(ids) - 1, ids[-1]), None

    def check_room(self, seq: LlamaSequence, max_new_tokens: int, step_input: int) -> None:
        T = seq.context_length + 1
        if T + max_new_tokens + step_input > self.n_ctx:
            raise UserError(f"llama.cpp engine: prompt ({T}) + max_new_tokens ({max_new_tokens}) + step input "
                            f"({step_input}) exceed its context of {self.n_ctx} tokens (n_ctx)")
        if step_input > self.max_step:
            raise UserError(f"llama.cpp engine: steps of {step_input} tokens exceed max_step {self.max_step}")

    def teacher_forced(self, ids: torch.Tensor, hidden: bool = False) -> Scored:
        """Logits [T, V] at every position of a token sequence, in chunks of max_step (a chain each); the
        cache is cleared after. Row i is what one-token decoding would compute there (chain exactness)."""
        if hidden:
            raise UserError("--engine llama.cpp: llama.cpp returns no hidden states")
        toks = [int(t) for t in torch.as_tensor(ids).reshape(-1).tolist()]
        if not toks or len(toks) > self.n_ctx:
            raise UserError(f"teacher forcing: expected 1..{self.n_ctx} tokens, got {len(toks)}")
        self._generation += 1
        self.clear()
        rows = []
        for start in range(0, len(toks), self.max_step):
            chunk = toks[start: start + self.max_step]
            rows.append(torch.from_numpy(self.decode_step(chunk, chain_shape(len(chunk)), start).copy()))
        self.clear()
        return Scored(torch.cat(rows), None)

    def forward_timer(self, spec) -> LlamaTimer:
        """decoder.engine.TimerSpec: one sequence, a chain (a tree only on an engine built with trees=True)."""
        if spec.batch_size != 1 or spec.packed:
            raise UserError("--engine llama.cpp: profiles batch size 1 only (one sequence per context)")
        if spec.cuda_graphs:
            raise UserError("--cuda-graphs: the llama.cpp engine runs on the CPU")
        self.reserve(spec.context_length + self.max_step + 1)
        return LlamaTimer(self, spec.context_length, spec.tree and self.caps.trees, spec.seed)


class LlamaSequence:
    """The engine's one sequence. Invariant: sequence 0 holds the `context_length` tokens before the
    root; between score and commit the step's tokens are in the cache too."""

    def __init__(self, engine: LlamaEngine, context_length: int, root: int):
        self.engine, self.generation = engine, engine._generation
        self.context_length = context_length
        self.root = torch.tensor([root], dtype=torch.long)
        self._shape: BatchShape | None = None

    def _live(self) -> LlamaEngine:
        if self.engine._generation != self.generation:
            raise RuntimeError("llama.cpp engine: this sequence was replaced by a later start()")
        return self.engine

    def score(self, step: StepInput) -> Scored:
        eng = self._live()
        lay = step.layout
        if step.extra_embeds is not None or lay.input_length != lay.num_tree:
            raise UserError("--engine llama.cpp: takes vocabulary tokens only (no PPD prompt-token inputs)")
        if step.hidden:
            raise UserError("--engine llama.cpp: llama.cpp returns no hidden states")
        shape = eng.shape_of(lay)
        if shape.n_paths > 1 and not eng.caps.trees:
            raise UserError("--engine llama.cpp: scores one chain per step (a tree's other paths would not be "
                            "token-identical to plain decoding, docs/llama-cpp.md); use a chain plan")
        logits = eng.decode_step(step.tokens.tolist(), shape, self.context_length)  # [n, V] batch order
        self._shape = shape
        out = torch.from_numpy(logits)
        if not shape.identity:
            out = out[list(shape.inverse)]  # layout order (a copy)
        return Scored(out, None)

    def commit(self, verdict) -> None:
        eng = self._live()
        if self._shape is None:
            raise RuntimeError("llama.cpp engine: commit without a scored step")
        eng.keep_path(self._shape, verdict.nodes[-1], self.context_length, len(verdict.nodes))
        self.context_length += len(verdict.nodes)
        self.root = verdict.root.reshape(1).cpu()
        self._shape = None

    def rollback(self, length: int) -> None:
        eng = self._live()
        if not 0 <= length <= self.context_length:
            raise ValueError(f"rollback to {length}: the cache holds {self.context_length} tokens")
        eng.keep(length)
        self.context_length = length
        self._shape = None


class LlamaTimer:
    """Forwards of n tokens after a random context, as the profiler times them: the tree (node i under
    (i - 1) // 2, one sequence id per path) or a chain, every row's logits. A chain-only engine (the
    default) times the one shape it scores, a chain, whatever `tree` says."""

    def __init__(self, engine: LlamaEngine, context_length: int, tree: bool, seed: int = 0):
        if not 1 <= context_length < engine.n_ctx - engine.max_step:
            raise UserError(f"--context-length: expected 1..{engine.n_ctx - engine.max_step - 1} for n_ctx "
                            f"{engine.n_ctx}, got {context_length}")
        self.engine, self.context_length, self.tree = engine, context_length, tree
        self.description = ("node i under node (i - 1) // 2, one sequence id per root-to-leaf path" if tree
                            else "n tokens of one sequence") + "; every row's logits"
        rng = np.random.default_rng(seed)
        self.tokens = rng.integers(0, engine.vocab_size, size=context_length + engine.max_step).tolist()
        engine._generation += 1  # any open sequence is gone
        engine.clear()
        engine.prefill(self.tokens[:context_length])

    def sample(self, n: int):
        eng, C = self.engine, self.context_length
        if not 1 <= n <= eng.max_step:
            raise UserError(f"input length {n}: the llama.cpp engine takes 1..{eng.max_step} tokens per step")
        shape = binary_tree_shape(n) if self.tree else chain_shape(n)
        tokens = self.tokens[C: C + n]
        eng.keep(C)

        def forward() -> None:
            eng.decode_step(tokens, shape, C)

        return forward

    def warm(self, n: int, times: int = 1) -> None:
        for _ in range(times):
            self.sample(n)()
        self.engine.keep(self.context_length)

    def drop(self, n: int) -> None:
        self.engine.keep(self.context_length)

    def close(self) -> None:
        self.engine.clear()
