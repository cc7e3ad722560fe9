"""Every hybrid guesser the main job races (lookup+draft, lookup+parallelspec, lookup+chain,
lookup+ppd), built the way autotune builds it (workflows.mainjob.candidates.dynamic_candidates, the
HybridGuesser over the run's guessers), decodes the built-in model greedily token-identical to
model.generate: on prompts that repeat themselves (lookup proposes) and prompts that do not."""
import pytest
import torch
from test_decoder_utils import reference

from decoder import DraftModelGuesser, PromptLookupGuesser, PromptTokens, generate
from decoder.torch_ops.draft_lm import build_draft_lm
from decoder.guessers.dynamic import HybridGuesser
from decoder.guessers.parallel import ParallelDrafter, arch_of
from planner.accept import from_entry
from workflows.cli.inputs import shipped
from workflows.mainjob.candidates import dynamic_candidates

torch.set_num_threads(1)

ACC = {  # acceptance as autotune's files give it (no calibration: the prior)
    "lookup": from_entry({"accuracy": [[0.4], [0.8], [0.85], [0.9]], "guesser": {"kind": "PromptLookupGuesser"}}),
    "draft": from_entry({"accuracy": [[0.5, 0.2, 0.1, 0.05]] * 4,
                         "guesser": {"kind": "DraftModelGuesser", "draft_s": 0.002, "draft_passes": "depth"}}),
    "parallelspec": from_entry({"accuracy": [[0.5, 0.2, 0.1, 0.05]] * 3,
                                "guesser": {"kind": "ParallelDrafter", "draft_s": 0.002, "draft_passes": "one"}}),
    "chain": from_entry({"accuracy": [[0.5, 0.2, 0.1, 0.05]] * 4,
                         "guesser": {"kind": "ParallelDrafter", "draft_s": 0.002, "draft_passes": "depth"}}),
}


@pytest.fixture(scope="module")
def builtin():
    from decoder.engines.hf.load import load_model

    return load_model("builtin", device="cpu", dtype="fp32").model


def _drafter(kind, target):
    torch.manual_seed(7)  # nothing but prompt tokens ships for the built-in model: untrained drafters
    if kind == "draft":
        return DraftModelGuesser(build_draft_lm(target, 1), top_k=4)
    if kind in ("parallelspec", "chain"):
        return ParallelDrafter(arch_of(target.config), num_masks=2, top_k=4,
                               mode="chain" if kind == "chain" else "parallel").to(torch.float32)
    return PromptTokens.load(shipped("builtin", "prompt_tokens"), model=target)


def _prompts(vocab):
    g = torch.Generator().manual_seed(1)
    rep = torch.randint(3, vocab, (7,), generator=g)
    return [torch.randint(3, vocab, (11,), generator=g), torch.cat([rep, rep, rep, rep[:4]])]


@pytest.mark.parametrize("drafter", ["draft", "parallelspec", "chain", "ppd"])
def test_each_hybrid_is_token_identical_to_generate(builtin, drafter):
    accept = {"lookup": ACC["lookup"]}
    if drafter == "ppd":
        pt = _drafter("ppd", builtin)
        accept["ppd"] = from_entry({"accuracy": [[0.5, 0.2, 0.1, 0.05]] * pt.num_prompt_tokens,
                                    "guesser": {"kind": "ppd", "num_prompt_tokens": pt.num_prompt_tokens,
                                                "ensemble": pt.ensemble}})
    else:
        accept[drafter] = ACC[drafter]
    (cand,) = dynamic_candidates(f"lookup+{drafter}", accept, None, max_size=8)
    g = HybridGuesser(PromptLookupGuesser(num_tokens=6), _drafter(drafter, builtin), drafter)
    draft_s = cand.tree.dynamic.guessers[drafter].draft_s
    sizes, passes = [], []
    for ids in _prompts(builtin.config.vocab_size):
        out = generate(builtin, ids, plan=cand.tree, guesser=g, max_new_tokens=24)
        assert out.tokens.tolist() == reference(builtin, ids, 24)
        sizes += out.stats.dynamic["sizes"]
        passes += [x / draft_s if draft_s else x for x in out.stats.dynamic["predicted_draft_s"]]
    assert max(sizes) > 0  # trees were built and verified, not only plain steps
    # each step's drafting is priced at whole passes of the plan's draft_s (lookup's guesses are free)
    assert len(passes) == len(sizes) and all(x >= 0 and abs(x - round(x)) < 1e-3 for x in passes)
    assert (max(passes) >= 1) == (draft_s > 0)
