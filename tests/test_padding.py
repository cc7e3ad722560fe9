"""Padding a forward to a longer, cheaper length: the profile prices it from raw medians with
enough runs (planner.profile), plans record it, and the decoder's outcome stays the unpadded one's."""
import numpy as np
import pytest
import torch
from test_decoder_utils import V, reference, static_tree, tiny_model

from decoder import OracleGuesser, generate
from planner.profile import RAW_MIN_REPEATS, profile_from_json

torch.set_num_threads(1)


def _doc(raw, reps):
    n = list(range(1, len(raw) + 1))
    fit = np.maximum.accumulate(np.array(raw, dtype=float))  # any monotone fit
    return {"input_lengths": n, "latency_s": raw, "repeats": reps,
            "fit": {"kind": "piecewise_linear", "input_lengths": n, "latency_s": fit.tolist()}}


def test_a_dip_measured_with_enough_runs_is_a_padding():
    raw = [0.042, 0.067, 0.083, 0.064, 0.057, 0.060, 0.074, 0.061]  # this CPU's shape: 2-3 tokens dearer than 5
    p = profile_from_json(_doc(raw, [20] * 8))
    assert p.pad_to == {2: 5, 3: 5, 4: 5, 7: 8}
    assert p.latency(3) == pytest.approx(0.057) and p.latency(7) == pytest.approx(0.061)
    assert np.all(np.diff(p.latency_s) >= 0)  # still non-decreasing: a padded length costs its target
    few = profile_from_json(_doc(raw, [RAW_MIN_REPEATS - 1] * 8))  # too few runs: the fit stands
    assert few.pad_to == {} and few.latency(5) == pytest.approx(0.083)


def test_plans_record_the_padding():
    from planner.accept import from_entry
    from planner.plan import plan

    p = profile_from_json(_doc([0.042, 0.067, 0.083, 0.064, 0.057, 0.060, 0.074, 0.061], [20] * 8))
    acc = from_entry({"accuracy": [[0.5, 0.2], [0.4, 0.2], [0.3, 0.1]]})
    tree = plan("medusa", acc, size=2, profile=p)
    assert tree.settings["pad_to"] == {"2": 5, "3": 5, "4": 5, "7": 8}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_padded_steps_decode_exactly_the_same(family):
    """A plan padded at every length decodes token-identical to greedy, and really runs m tokens."""
    model = tiny_model(family, seed=2)
    ids = torch.randint(1, V, (12,), generator=torch.Generator().manual_seed(1))
    want = reference(model, ids, 20)
    tree = static_tree("medusa", 5, 3, seed=1)
    tree.settings["pad_to"] = {str(n): n + 3 for n in range(2, 7)}
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(o.shape[1]))
    g = OracleGuesser(torch.cat([ids, torch.tensor(want)]), V, 3, top_k=4, accuracy=[0.6, 0.3, 0.1, 0.0], seed=3)
    out = generate(model, ids, plan=tree, guesser=g, max_new_tokens=20)
    hook.remove()
    assert out.tokens.tolist() == want
    assert seen[0] == 11 and 9 in seen[1:] and 6 not in seen[1:]  # after the prefill: 6-token tree steps ran at 9


def test_padded_ppd_steps_decode_exactly_the_same():
    """Prompt tokens enter as embeddings: the padding is appended after them."""
    from test_decoder_utils import ppd_tree

    from decoder import PromptTokens

    model = tiny_model("llama", seed=2)
    ids = torch.randint(1, V, (12,), generator=torch.Generator().manual_seed(4))
    want = reference(model, ids, 16)
    tree = ppd_tree(2, [0, 3, 6])
    tree.settings["pad_to"] = {str(n): n + 2 for n in range(2, 40)}
    out = generate(model, ids, plan=tree, guesser=PromptTokens.random(model, 2, seed=5, top_k=4), max_new_tokens=16)
    assert out.tokens.tolist() == want
