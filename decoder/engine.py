"""The target engine: what runs the model being decoded (the scorer, in vLLM's words).

A decoding step has three roles, each behind one interface:
  proposer  the guesser's session puts a tree of candidate tokens forward (decoder/guesser.py),
  scorer    the engine runs root + tree in one forward pass and returns their logits (this file),
  rule      a verification rule picks the accepted path (decoder/verify.py),
after which the engine keeps the accepted path in its KV cache and drops the rest (commit).

Two engines stand behind it: Hugging Face transformers (decoder/engines/hf/engine.py: any causal LM, fp32 or
bf16, CPU or CUDA, the matmul paths and the Triton tree kernels) and llama.cpp (decoder/engines/llama_cpp/engine.py:
a GGUF file through llama-cpp-python). The profiler times an engine through `forward_timer`, the
acceptance pass and every decoding loop (plain, trees, per-step trees, PEARL, MTAD, batches) reach the
model only through an engine, so a third engine is one module implementing this file's protocols.

What an engine cannot do it says in `caps`, and a guesser that needs it is refused in one line
before anything runs (`refuse`): llama.cpp returns no hidden states (ParallelSpec drafters read
them) and takes only vocabulary tokens as input (PPD's prompt tokens are trained embeddings).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from planner.errors import UserError

if TYPE_CHECKING:
    from decoder.layout import StepLayout
    from decoder.verify import Verdict


@dataclass(frozen=True)
class EngineCaps:
    """What an engine can do; guessers and workflows ask these instead of comparing engine names."""

    name: str  # the engine's name in plan files and on the command line: "hf", "llama.cpp"
    hidden_states: bool  # returns the target's last hidden state per input (ParallelSpec, chain, PPD training)
    input_embeddings: bool  # takes inputs that are not vocabulary tokens (PPD prompt tokens)
    trees: bool  # scores a tree (tokens sharing ancestors) in one forward; False: one chain per step
    batches: bool  # decodes several sequences in one forward (decoder/batch.py)
    threads: int | None = None  # CPU threads the engine computes with (None: the library's choice)


@dataclass
class StepInput:
    """One scored forward: the root and the proposal's candidates, in the step layout's order."""

    tokens: torch.Tensor  # [num_tree] long, root first, on the engine's device
    layout: StepLayout  # parents, depths (position offsets), the [n, n] visibility block, paths
    extra_embeds: torch.Tensor | None = None  # [n - num_tree, hidden] non-token inputs after the tree (PPD)
    hidden: bool = False  # also return the last hidden state of every input


class Scored(NamedTuple):
    logits: torch.Tensor  # [n, V] one row per input (root first); n = layout.input_length
    hidden: torch.Tensor | None  # [n, hidden] when asked and the engine has them


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


class ForwardTimer(Protocol):
    """The profiler's cheap timing call: forwards of n new tokens after a fixed context."""

    def warm(self, n: int, times: int = 1) -> None:
        """Build the input for n tokens and run it `times` times untimed (first-call costs)."""
        ...

    def sample(self, n: int) -> Callable[[], None]:
        """Reset the cache to the context (untimed) and return one forward of n tokens to time."""
        ...

    def drop(self, n: int) -> None:
        """Forget length n (after an out-of-memory error there) and restore the context."""
        ...


class Engine(Protocol):
    caps: EngineCaps
    model_name: str  # what records (acceptance, profiles) call the target
    vocab_size: int
    device: torch.device
    dtype: torch.dtype  # of the logits it returns and of any input embeddings it takes
    max_positions: int | None  # longest sequence (prompt + answer + step inputs); None: unbounded

    def eos_ids(self) -> set[int]:
        """The model's end-of-sequence tokens."""
        ...

    def start(self, prompt_ids: torch.Tensor, hidden: bool = False,
              pad_to: dict[int, int] | None = None) -> tuple[Sequence, torch.Tensor | None]:
        """Prefill every prompt token but the last, which becomes the first root. Returns the sequence
        and, with hidden=True, the last hidden state over the prefilled tokens [T-1, hidden].
        pad_to {n: m}: run n-input steps at m inputs where the profile measured m cheaper (inputs
        nothing reads; planner.profile's padding, which a plan records); an engine may ignore it."""
        ...

    def check_room(self, seq: Sequence, max_new_tokens: int, step_input: int) -> None:
        """A one-line error when prompt + max_new_tokens + the largest step input cannot fit the engine
        (the model's positions, a sliding window, a context size)."""
        ...

    def teacher_forced(self, ids: torch.Tensor, hidden: bool = False) -> Scored:
        """Logits [T, V] (and hidden states) at every position of a token sequence [T] in one pass,
        no cache kept: the acceptance pass reads what the target predicts along a known text."""
        ...

    def forward_timer(self, context_length: int, batch_size: int = 1, tree: bool = True) -> ForwardTimer:
        """Forwards after a random context of `context_length` tokens: a tree (node i under (i-1)//2,
        every logit) or a chain; batch_size sequences where the engine batches."""
        ...

    # engines with caps.batches also have:
    #   batch_runner(layout, seqs, started_sequences, want_hidden) -> a runner with forward(live,
    #   proposals, stats) -> per-sequence (logits, hidden), commit(live, proposals, verdicts, stats),
    #   drop(finished), close()  (decoder/batch.py drives it)


@dataclass(frozen=True)
class Needs:
    """What a guesser needs of the target engine (decoder/guessers/registry.py states it per kind)."""

    hidden_states: bool = False
    input_embeddings: bool = False
    trees: bool = False  # its proposals branch (siblings); a chain-only engine cannot score them
    hf_model: bool = False  # it reads the target's own torch modules (embeddings, LM head)


def refuse(caps: EngineCaps, kind: str, needs: Needs) -> None:
    """A one-line error when an engine cannot run a guesser, before anything is loaded or decoded."""
    lacking = [what for what, need, have in (
        ("hidden states", needs.hidden_states, caps.hidden_states),
        ("non-token input embeddings", needs.input_embeddings, caps.input_embeddings),
        ("tree-shaped forwards", needs.trees, caps.trees),
        ("the target's torch modules", needs.hf_model, caps.name == "hf"),
    ) if need and not have]
    if lacking:
        raise UserError(f"--engine {caps.name}: the {kind} guesser needs {' and '.join(lacking)}, which the "
                        f"{caps.name} engine does not give; use --engine hf, or another guesser")


def torch_model(target):
    """The transformers model behind a target (an HFEngine's, or a bare model): for guessers that
    share the target's embeddings or LM head (ParallelSpec, the project's draft LM)."""
    model = getattr(target, "model", None) if hasattr(target, "caps") else target
    if model is None or not hasattr(model, "get_input_embeddings"):
        name = target.caps.name if hasattr(target, "caps") else type(target).__name__
        raise UserError(f"--engine {name}: this guesser shares the target's torch modules, which the {name} engine "
                        "does not have; use --engine hf")
    return model


def vocab_size(target) -> int:
    """The target's vocabulary size (an engine's, or a bare model's embedding rows)."""
    if hasattr(target, "caps"):
        return int(target.vocab_size)
    return int(target.get_input_embeddings().weight.shape[0])
