"""planner/export_heads.py and `planner export --drafter`: the trees engines grow for EAGLE heads priced against
closed forms, TensorRT-LLM's eagle_choices prefix-closed, and the head's export for vLLM, SGLang and
TensorRT-LLM written from its acceptance and a profile, with bad inputs refused in one line."""
import itertools
import json

import numpy as np
import pytest

from planner.accept import Acceptance
from planner.export_heads import best_budget, budget_tokens, chain_loss, eagle_choices, grown_tree
from planner.profile import LatencyProfile

ROWS = np.array([[0.6, 0.15, 0.05], [0.7, 0.12, 0.04], [0.75, 0.1, 0.03], [0.8, 0.08, 0.02]])


def _profile(slope=0.01):
    n = np.arange(1, 65)
    return LatencyProfile(n, 0.05 * (1 + slope * (n - 1)))


def test_a_chain_budget_is_the_chains_closed_form():
    for S in range(1, 5):
        assert budget_tokens(ROWS, S, 1, S + 1) == pytest.approx(1 + sum(np.prod(ROWS[:d, 0]) for d in range(1, S + 1)))


def test_a_budget_holding_every_node_is_the_cartesian_trees_sum():
    """With K at least the ranks and N - 1 every drafted node, growth keeps the whole Cartesian tree of depth S
    when the frontier holds every node (K^d <= K at d = 1 only, so S = 2, K = 3: frontier 3 = all level-1 nodes)."""
    S, K = 2, 3
    drafted = grown_tree(ROWS, S, K)
    everything = 1 + sum(ROWS[0, r1] * ROWS[1, r2] for r1, r2 in itertools.product(range(3), repeat=2)) + ROWS[0].sum()
    assert len(drafted) == K + K * K
    assert budget_tokens(ROWS, S, K, len(drafted) + 1) == pytest.approx(everything)


def test_growth_keeps_the_k_best_frontier():
    """Depth 3 from a frontier of 2: the third level grows only under the two best depth-2 nodes."""
    drafted = dict(grown_tree(ROWS, 3, 2))
    level2 = sorted((p for p in drafted if len(p) == 2), key=lambda p: -drafted[p])[:2]
    assert {p[:2] for p in drafted if len(p) == 3} == set(level2)


def test_eagle_choices_are_prefix_closed_and_priced_as_their_tree():
    from planner.candidate import tree_tau

    choices, budget = eagle_choices(Acceptance(ROWS), _profile(), 0.002)
    paths = {tuple(p) for p in choices}
    assert all(p[:-1] in paths or len(p) == 1 for p in paths)
    assert budget.expected_tokens == pytest.approx(tree_tau(ROWS, [tuple(p) for p in choices]))
    assert budget.draft_tokens == len(choices) + 1


def test_a_flat_profile_prefers_a_wide_tree_and_a_steep_one_a_chain():
    acc = Acceptance(ROWS)
    flat = best_budget(acc, _profile(0.001), 0.001)
    steep = best_budget(acc, _profile(0.8), 0.001)
    assert flat.draft_tokens > steep.draft_tokens and steep.topk == 1
    loss = chain_loss(acc, _profile(0.001), 0.001)
    assert loss["chain_over_tree"] < 1 <= loss["tree_over_plain"]


@pytest.fixture
def head(tmp_path):
    from head_layouts import random_head, write_eagle3
    from test_decoder_utils import tiny_model

    from decoder.torch_ops.eagle import EAGLE3

    folder = write_eagle3(random_head(tiny_model("llama", seed=1), EAGLE3, seed=2), tmp_path / "head")
    acc = {"accuracy": ROWS.tolist(), "guesser": {"kind": "eagle-head", "draft_s": 0.002}}
    (folder / "accept_heldout.json").write_text(json.dumps(acc))
    prof = tmp_path / "profile.json"
    n = list(range(1, 33))
    series = [{"batch_size": b, "input_lengths": n, "latency_s": [0.05 * b ** 0.5 * (1 + 0.01 * b * (k - 1)) for k in n]}
              for b in (1, 4, 16)]
    prof.write_text(json.dumps({"input_lengths": n, "latency_s": series[0]["latency_s"], "series": series}))
    return folder, prof


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
def test_the_heads_export_for_each_engine(head, tmp_path, engine):
    from workflows.cli.main import main

    folder, prof = head
    out = tmp_path / f"{engine}.json"
    assert main(["export", "--engine", engine, "--drafter", str(folder), "--profile", str(prof), "-q", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    if engine == "vllm":
        cfg = doc["speculative_config"]
        assert cfg["method"] == "eagle3" and cfg["model"] == str(folder)
        sched = cfg["num_speculative_tokens_per_batch_size"]  # a chain per profiled batch-size range
        assert sched[0][0] == 1 and sched[-1][1] == 4096 and sched[-1][2] < sched[0][2]  # shorter when steps cost more
    elif engine == "sglang":
        args = doc["server_args"]
        assert args[args.index("--speculative-algorithm") + 1] == "EAGLE3"
        assert int(args[args.index("--speculative-num-draft-tokens") + 1]) >= 2
    else:
        cfg = doc["speculative_config"]
        assert ("eagle_choices" in cfg) != bool(cfg.get("use_dynamic_tree"))
    assert any("chain-only engine" in n for n in doc["notes"])


@pytest.mark.parametrize("extra,match", [
    ([], "give --profile FILE"),
    (["--profile", "PROF", "--accept", "NOACC"], "no 'guesser.draft_s'"),
    (["--profile", "PROF", "--engine", "hf"], "engine 'hf' runs no EAGLE head; use one of vllm, sglang, trtllm"),
])
def test_bad_head_exports_are_one_line(head, tmp_path, capsys, extra, match):
    from workflows.cli.main import main

    folder, prof = head
    noacc = tmp_path / "noacc.json"
    noacc.write_text(json.dumps({"accuracy": ROWS.tolist()}))
    argv = ["export", "--engine", "vllm", "--drafter", str(folder), "-o", str(tmp_path / "x.json")]
    argv += [str(prof) if a == "PROF" else str(noacc) if a == "NOACC" else a for a in extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err
    assert not (tmp_path / "x.json").exists()
