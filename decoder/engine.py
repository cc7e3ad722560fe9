"""The target engine: what runs the model being decoded (the scorer, in vLLM's words).

A decoding step has three roles, each behind one interface:
  proposer  the guesser's session puts a tree of candidate tokens forward (decoder/guesser.py),
  scorer    the engine runs root + tree in one forward pass and returns their logits (this file),
  rule      a verification rule picks the accepted path (decoder/verify.py),
after which the engine keeps the accepted path in its KV cache and drops the rest (commit).

Two engines stand behind it: Hugging Face transformers (decoder/engines/hf/engine.py: any causal LM, fp32 or
bf16, CPU or CUDA, the matmul paths and the Triton tree kernels) and llama.cpp (decoder/engines/llama_cpp/engine.py:
a GGUF file through llama-cpp-python). The profiler times an engine through `forward_timer`, the
acceptance pass and the decoding loop (decoder/loop.py: plain, trees, per-step trees, PEARL, MTAD, batches)
reach the model only through an engine, so a third engine is one module implementing this file's protocols.

What an engine cannot do it says in `caps`, and a guesser that needs it is refused in one line
before anything runs (`refuse`): llama.cpp returns no hidden states (ParallelSpec drafters read
them) and takes only vocabulary tokens as input (PPD's prompt tokens are trained embeddings).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from planner.engines import EngineCaps  # noqa: F401 (the registry's, re-exported)
from planner.errors import UserError

if TYPE_CHECKING:
    from decoder.layout import StepLayout
    from decoder.verify import Verdict


# The target features a drafter reads, which the engine returns beside the logits: False (none), True (the
# last hidden state, after the final norm: ParallelSpec's and EAGLE-1's input), or a tuple of layer ids (the
# residual streams entering those layers, concatenated in that order: EAGLE-3's three layers).
Features = bool | tuple[int, ...]


@dataclass
class StepInput:
    """One scored forward: the root and the proposal's candidates, in the step layout's order."""

    tokens: torch.Tensor  # [num_tree] long, root first, on the engine's device
    layout: StepLayout  # parents, depths (position offsets), the [n, n] visibility block, paths
    extra_embeds: torch.Tensor | None = None  # [n - num_tree, hidden] non-token inputs after the tree (PPD)
    hidden: Features = False  # also return these features of every input


class Scored(NamedTuple):
    logits: torch.Tensor  # [n, V] one row per input (root first); n = layout.input_length
    hidden: torch.Tensor | None  # [n, F] the features asked for, when the engine has them


class Sequence(Protocol):
    """One sequence inside an engine. Invariant: the cache holds every token before the root; the
    root (the target's own last token, not yet scored) is not in it."""

    context_length: int  # tokens in the cache = the root's position
    root: torch.Tensor  # [1] long on the engine's device

    def score(self, step: StepInput) -> Scored:
        """One forward of the step's inputs after the cache; the cache grows by the inputs until commit."""
        ...

    def commit(self, verdict: Verdict) -> None:
        """Keep the root and the accepted path (verdict.path, tree indices from 0) in the cache, drop the
        rest of the step's inputs, and make verdict.root the next root."""
        ...

    def rollback(self, length: int) -> None:
        """Cut the cache back to its first `length` tokens (the root is unchanged)."""
        ...


@dataclass(frozen=True)
class TimerSpec:
    """The forwards a profile times: n new tokens after a random context of `context_length` tokens."""

    context_length: int
    batch_size: int = 1  # sequences per forward (engines with caps.batches)
    tree: bool = True  # a tree (node i under (i - 1) // 2, every row's logits) or a chain; chain-only engines time chains
    packed: bool = False  # the batch's rows as one packed row (EMS-SD's layout, decoder/batch.py)
    cuda_graphs: bool = False  # each length captured once and replayed (CUDA)
    seed: int = 0  # the random context's and tokens' draws


class ForwardTimer(Protocol):
    """The profiler's cheap timing call: forwards of n new tokens after a fixed context."""

    description: str  # the timed input in words (the tree's shape, the position ids), for the profile file

    def warm(self, n: int, times: int = 1) -> None:
        """Build the input for n tokens and run it `times` times untimed (first-call costs)."""
        ...

    def sample(self, n: int) -> Callable[[], None]:
        """Reset the cache to the context (untimed) and return one forward of n tokens to time."""
        ...

    def drop(self, n: int) -> None:
        """Forget length n (after an out-of-memory error there) and restore the context."""
        ...

    def close(self) -> None:
        """Undo what timing switched on (a packed attention path) and free the context."""
        ...


class Engine(Protocol):
    """The one door to a model: profiling, acceptance, calibration and replay, decoding, the race and
    the main job reach the model only through these (opened once at the command-line boundary by
    decoder/engines/registry.py); what an engine lacks it says in `caps`."""

    caps: EngineCaps
    model_name: str  # what records (acceptance, profiles) call the target
    vocab_size: int
    device: torch.device
    dtype: torch.dtype  # of the logits it returns and of any input embeddings it takes
    max_positions: int | None  # longest sequence (prompt + answer + step inputs); None: unbounded
    tokenizer: object  # the model's tokenizer with its chat template (None: a model without one, e.g. a preset)

    def eos_ids(self) -> set[int]:
        """The model's end-of-sequence tokens."""
        ...

    def record(self) -> dict:
        """What files record about the target: engine, model, source, weights, arithmetic, device, threads."""
        ...

    def versions(self) -> dict:
        """The libraries the engine computes with, and their versions (profiles record them)."""
        ...

    def start(self, prompt_ids: torch.Tensor, hidden: Features = False,
              pad_to: dict[int, int] | None = None) -> tuple[Sequence, torch.Tensor | None]:
        """Prefill every prompt token but the last, which becomes the first root. Returns the sequence
        and, with `hidden`, those features over the prefilled tokens [T-1, F].
        pad_to {n: m}: run n-input steps at m inputs where the profile measured m cheaper (inputs
        nothing reads; planner.profile's padding, which a plan records); an engine may ignore it."""
        ...

    def check_room(self, seq: Sequence, max_new_tokens: int, step_input: int) -> None:
        """A one-line error when prompt + max_new_tokens + the largest step input cannot fit the engine
        (the model's positions, a sliding window, a context size)."""
        ...

    def teacher_forced(self, ids: torch.Tensor, hidden: Features = False) -> Scored:
        """Logits [T, V] (and the features asked for) at every position of a token sequence [T] in one pass,
        no cache kept: the acceptance pass reads what the target predicts along a known text."""
        ...

    def stock_generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, sampling=None,
                       seed: int = 0) -> tuple[list[int], float]:
        """The engine's library's own generation (transformers' generate, llama.cpp's): the baseline a
        user would otherwise run. (new tokens up to and including EOS, wall seconds with the prefill)."""
        ...

    def check_lengths(self, input_lengths: list[int], context_length: int, batch_size: int = 1) -> None:
        """A one-line error when a profile's forwards cannot fit (positions, context, memory)."""
        ...

    def forward_timer(self, spec: TimerSpec) -> ForwardTimer:
        """Forwards after a random context, as `spec` says; an engine refuses what it cannot time."""
        ...

    def reserve(self, tokens: int) -> None:
        """Room for sequences of up to `tokens` tokens before decoding starts (an engine with a fixed
        context sizes it to what the run needs; the others need nothing)."""
        ...

    def close(self) -> None:
        """Release the engine's model (a library context, a server)."""
        ...

    # engines with caps.batches also have:
    #   batch_runner(layout, seqs, started_sequences, want_hidden) -> a runner with forward(live,
    #   proposals, stats) -> per-sequence (logits, hidden), commit(live, proposals, verdicts, stats),
    #   drop(finished), close()  (decoder/batch.py drives it)
    # caps.torch_modules (the target's torch modules, lent through narrow methods, never the model itself):
    #   open_drafter(path, label) -> a decoder/drafter.py DraftModel on this engine (the project's draft LM on
    #   its embedding and head, a causal LM folder, or an EAGLE-1/3 head checked against the model): the draft
    #   guesser, EAGLE heads, PEARL, MTAD; open_heads(path) -> Medusa heads checked against the model;
    #   token_modules() -> (input embedding, LM head), frozen, for drafters built on them (ParallelSpec, PPD);
    #   context_forwards(context [C]) -> forwards of new tokens after that context, prefilled once and cut back
    #   after each use (forward(ids, positions), reset(), context_length, vocab_size): PEARL's side timings
    #   (profiler/overlap.py); training() -> the passes training backpropagates through (the teacher's
    #   outputs, PPD's prompt pass, drafters built on the target): decoder/engines/hf/training.py.
    # caps.matmul_paths: choose_matmul_paths(rows, context_length, budget_s, seed, progress) -> the
    #   profile's "matmul_paths"; use_matmul_paths(profile file | table | None)
    # caps.tree_kernels: select_attention("auto" | "kernels" | "dense")


@dataclass(frozen=True)
class Needs:
    """What a guesser needs of the target engine (decoder/guessers/registry.py states it per kind)."""

    hidden_states: bool = False
    input_embeddings: bool = False
    trees: bool = False  # its proposals branch (siblings); a chain-only engine cannot score them
    hf_model: bool = False  # it reads the target's own torch modules (embeddings, LM head)


def lacking(caps: EngineCaps, needs: Needs) -> list[str]:
    """What a guesser with these needs would miss on an engine with these capabilities."""
    return [what for what, need, have in (
        ("hidden states", needs.hidden_states, caps.hidden_states),
        ("non-token input embeddings", needs.input_embeddings, caps.input_embeddings),
        ("tree-shaped forwards", needs.trees, caps.trees),
        ("the target's torch modules", needs.hf_model, caps.torch_modules),
    ) if need and not have]


def refuse(caps: EngineCaps, kind: str, needs: Needs) -> None:
    """A one-line error when an engine cannot run a guesser, before anything is loaded or decoded;
    it names the registered engines that can."""
    missing = lacking(caps, needs)
    if missing:
        from planner.engines import kinds

        able = [k.name for k in kinds() if not lacking(k.caps, needs)]
        instead = f"use --engine {' or '.join(able)}, or another guesser" if able else "use another guesser"
        raise UserError(f"--engine {caps.name}: the {kind} guesser needs {' and '.join(missing)}, which the "
                        f"{caps.name} engine does not give; {instead}")


def vocab_size(target) -> int:
    """The target engine's vocabulary size (Engine.vocab_size). A bare model is wrapped by
    decoder.engines.registry.as_engine, which this protocol module cannot import (the engines import it), so
    callers that may hold one ask `as_engine(target).vocab_size` themselves; until the guessers that call this
    do (an MTAD session may begin on a bare drafter), a bare transformers causal LM answers through the
    `vocab_size` attribute its class sets."""
    return int(target.vocab_size)


def is_oom(e: BaseException) -> bool:
    """An out-of-memory error of torch on any device (the profiler drops the length and goes on)."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    msg = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)
