"""The guesser registry (planner/guessers.py, decoder/guessers/registry.py) and the engine seam's refusals."""
from __future__ import annotations

import pytest
import torch

from decoder import generate
from decoder.engine import EngineCaps, Needs, refuse
from decoder.engines.hf.engine import HFEngine
from decoder.engines.hf.load import load_model
from decoder.guesser import Proposal
from decoder.guessers.registry import LoadRequest, kind_of, load_guesser
from decoder.layout import layout_for
from planner.errors import UserError
from planner.guessers import GuesserKind, kind, kind_of_record, names, register, unregister


@pytest.fixture(scope="module")
def model():
    return load_model("builtin").model


class EveryOtherToken:
    """A toy guesser: proposes the token two back as a one-token chain (right on repeated text)."""

    needs_hidden = False

    def check(self, plan, label="plan"):
        pass

    def begin(self, target, plan, prompt_ids, ctx):
        return _ToySession(prompt_ids.reshape(-1).tolist()[:-1], ctx)


class _ToySession:
    max_input_length = 2

    def __init__(self, history, ctx):
        self.history, self.ctx = history, ctx

    def propose(self, root):
        self.history.append(int(root[0]))
        guess = self.history[-2:-1]
        layout = layout_for(((0,),) if guess else (), 1, self.ctx.dtype, self.ctx.device)
        return Proposal(layout, torch.tensor(guess, dtype=torch.long, device=root.device))

    def commit(self, outcome):
        self.history.extend(outcome.verdict.emitted[:-1])


def test_a_toy_guesser_is_one_registry_entry_and_decodes_exactly(model):
    register(GuesserKind("toy", "proposes the token two back", lambda req: EveryOtherToken(), signal="none",
                         passes="none", branches=False))
    try:
        assert "toy" in names()
        g = load_guesser("toy", LoadRequest(HFEngine(model)))
        assert kind_of(g).name == "toy" and g.source_dir is None
        ids = torch.tensor([5, 6, 5, 6, 5, 6, 7, 8, 9])
        out = generate(model, ids, plan=None, guesser=g, max_new_tokens=24)
        ref = model.generate(ids[None], max_new_tokens=24, do_sample=False, eos_token_id=None)[0, ids.numel():]
        assert out.tokens.tolist() == ref[: out.tokens.numel()].tolist() and out.tokens.numel() == 24
    finally:
        unregister("toy")
    assert "toy" not in names()


def test_unknown_kinds_and_paths_fail_in_one_line():
    with pytest.raises(UserError, match="expected one of .*lookup"):
        kind("lookupp")
    with pytest.raises(ValueError, match="registered already"):
        register(GuesserKind("lookup", "again", "decoder.guessers.lookup:load"))
    with pytest.raises(UserError, match="needs its draft_lm directory"):
        load_guesser("draft", LoadRequest(object()))


def test_old_acceptance_records_name_their_kind():
    assert kind_of_record({"kind": "PromptLookupGuesser"}).name == "lookup"
    assert kind_of_record({"kind": "ParallelDrafter", "draft_passes": "one"}).name == "parallelspec"
    assert kind_of_record({"kind": "ParallelDrafter", "draft_passes": "depth"}).name == "chain"
    assert kind_of_record({"kind": "ppd"}).name == "ppd"
    assert kind_of_record({"kind": "Nothing"}) is None


def test_an_engine_without_hidden_states_refuses_drafters_that_read_them():
    caps = EngineCaps("toy-engine", hidden_states=False, input_embeddings=False, trees=True, batches=False)
    for name in ("parallelspec", "chain", "ppd", "lookup+ppd"):
        k = kind(name)
        with pytest.raises(UserError, match="--engine toy-engine: the .* guesser needs"):
            refuse(caps, k.name, Needs(k.needs_hidden, k.needs_embeddings, False, k.needs_torch))
    refuse(caps, "lookup", Needs())  # needs nothing: runs anywhere
