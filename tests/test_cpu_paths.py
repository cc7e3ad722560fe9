"""CPU matmul paths (decoder/engines/hf/cpu_paths.py, decoder/engines/hf/matmul_choice.py, planner/matmul_paths.py):
every path computes F.linear to fp32 rounding, decoding with any assignment of paths is
token-identical to plain decoding without them (tiny models: exactly), the profile key is
validated on load and older profiles still load, and the profiler's choice round-trips."""
import json
import re

import pytest
import torch
from test_decoder_utils import V, ppd_tree, reference, static_tree, tiny_model

import decoder.engines.hf.cpu_paths as cp
from decoder import PromptTokens, generate
from planner.errors import UserError
from planner.jsonio import atomic_write_json
from planner.matmul_paths import MATMUL_PATHS, load_matmul_paths, matmul_paths_from_json
from planner.profile import load_batch_profiles, load_profile

torch.set_num_threads(1)


def _table_json(model, rows, pick):
    """Every Linear shape of `model` on path pick(M, shape) at each row count."""
    shapes = sorted({(m.out_features, m.in_features) for _, m in cp.linears(model)})
    return {"version": 1, "rows": rows, "dtype": "fp32",
            "shapes": [{"out_features": o, "in_features": i, "paths": [pick(M, (o, i)) for M in rows]}
                       for o, i in shapes]}


@pytest.mark.parametrize("path", MATMUL_PATHS)
@pytest.mark.parametrize("bias", [False, True])
def test_every_path_is_f_linear_to_fp32_rounding(path, bias, monkeypatch):
    monkeypatch.setattr(cp, "CHUNK_ROWS", 48)  # several blocks and a ragged last one
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(40, 200, bias=bias)
    for M in (1, 2, 3, 7, 16):
        x = torch.randn(1, M, 40, generator=g)
        fn = cp.path_fn(path, lin.weight, lin.bias, cp.make_layout(lin.weight, path))
        with torch.inference_mode():
            got, want = fn(x), torch.nn.functional.linear(x, lin.weight, lin.bias)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


ROTATE = ("t", "onednn", "chunked", "linear")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_decoding_with_paths_is_token_identical(model, monkeypatch):
    monkeypatch.setattr(cp, "CHUNK_ROWS", 48)
    rows = list(range(1, 40))
    table = matmul_paths_from_json(_table_json(model, rows, lambda M, s: ROTATE[(M + s[0]) % 4]))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, V, (t,), generator=g) for t in (1, 5, 12)]
    tree = ppd_tree(2, [0, 3, 8])
    guesser = PromptTokens.random(model, 2, seed=0, top_k=4)
    want_plain = [generate(model, ids, max_new_tokens=20).tokens.tolist() for ids in prompts]
    want_tree = [generate(model, ids, plan=tree, guesser=guesser, max_new_tokens=20).tokens.tolist() for ids in prompts]
    try:
        extra = cp.install_paths(model, table)
        assert extra > 0 and cp.installed_bytes(model) == extra
        assert all("forward" in m.__dict__ for _, m in cp.linears(model))
        for ids, plain, tree_out in zip(prompts, want_plain, want_tree):
            assert generate(model, ids, max_new_tokens=20).tokens.tolist() == plain == reference(model, ids, 20)
            assert generate(model, ids, plan=tree, guesser=guesser, max_new_tokens=20).tokens.tolist() == tree_out
            out = generate(model, ids, plan=static_tree("medusa", 6, 2), guesser=guesser, max_new_tokens=20)
            assert out.tokens.tolist() == plain
    finally:
        cp.remove_paths(model)
    assert not any("forward" in m.__dict__ for _, m in cp.linears(model))
    assert cp.installed_bytes(model) == 0


def test_one_layout_per_weight_and_paths_switch_off(model):
    rows = [1, 2, 3]
    table = matmul_paths_from_json(_table_json(model, rows, lambda M, s: "t"))
    try:
        extra = cp.install_paths(model, table)
        weights = {m.weight.data_ptr(): m.weight for _, m in cp.linears(model)}
        assert extra == sum(w.numel() * 4 for w in weights.values())  # one transposed copy each, no more
        x = torch.randn(1, 2, model.config.hidden_size)
        lin = model.model.layers[0].mlp.gate_proj
        with torch.inference_mode():
            on = lin(x)
            cp.set_paths_enabled(model, False)
            off = lin(x)
        torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-5)
    finally:
        cp.remove_paths(model)


def test_use_profile_paths_reads_the_file_and_skips_other_dtypes(model, tmp_path):
    prof = tmp_path / "p.json"
    atomic_write_json(prof, {"input_lengths": [1, 2], "latency_s": [0.01, 0.02], "dtype": "fp32",
                             "matmul_paths": _table_json(model, [1, 2], lambda M, s: "onednn")})
    try:
        assert cp.use_profile_paths(model, prof) is not None and cp.installed_bytes(model) > 0
        generate(model, torch.tensor([3, 4, 5]), max_new_tokens=3, matmul_paths=prof)  # same table: no rebuild
        bf16 = json.loads(prof.read_text())
        bf16["matmul_paths"]["dtype"] = "bf16"
        prof.write_text(json.dumps(bf16))
        assert cp.use_profile_paths(model, prof) is None and cp.installed_bytes(model) == 0
    finally:
        cp.remove_paths(model)


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d.update(version=2), "matmul_paths.version"),
    (lambda d: d.update(rows=[2, 1]), "matmul_paths.rows"),
    (lambda d: d.update(rows=[0]), "matmul_paths.rows[0]"),
    (lambda d: d["shapes"][0].update(paths=["t"]), "matmul_paths.shapes[0].paths"),
    (lambda d: d["shapes"][0]["paths"].__setitem__(0, "bf16"), "matmul_paths.shapes[0].paths[0]"),
    (lambda d: d["shapes"][0].update(out_features=-1), "matmul_paths.shapes[0].out_features"),
    (lambda d: d["shapes"].append(dict(d["shapes"][0])), "matmul_paths.shapes[1]"),
    (lambda d: d.update(extra_bytes="x"), "matmul_paths.extra_bytes"),
])
def test_bad_matmul_paths_name_the_field(tmp_path, mutate, field):
    mp = {"version": 1, "rows": [1, 2], "shapes": [{"out_features": 8, "in_features": 4, "paths": ["t", "linear"]}]}
    mutate(mp)
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"input_lengths": [1, 2], "latency_s": [0.01, 0.02], "matmul_paths": mp}))
    for load in (load_profile, load_batch_profiles, load_matmul_paths):
        with pytest.raises(UserError, match=re.escape(f"field '{field}")):
            load(str(path))


def test_profiles_without_the_key_still_load(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"input_lengths": [1, 2], "latency_s": [0.01, 0.02]}))
    assert load_profile(str(path)).max_input_length == 2
    assert load_matmul_paths(path) is None


def test_profiler_chooses_validates_and_stores_the_paths(tmp_path):
    from profiler.measure import profile_model

    m = tiny_model("llama", seed=1)
    try:
        prof = profile_model(m, [1, 2, 3, 8, 20], context_length=8, time_budget_s=3, min_repeats=2, max_repeats=3,
                             progress=False, overhead=False, matmul_budget_s=6, matmul_max_rows=8)
        mp = prof["matmul_paths"]
        assert mp["rows"] == [1, 2, 3, 8] and mp["device"] == "cpu" and mp["dtype"] == "fp32"
        shapes = {(s["out_features"], s["in_features"]) for s in mp["shapes"]}
        assert shapes == {(mm.out_features, mm.in_features) for _, mm in cp.linears(m)}
        for s in mp["shapes"]:
            assert set(s["best_s"]) >= {"linear", "t", "onednn"} and len(s["fastest_isolated"]) == 4
            if "whole_model" in mp:  # rows where the whole forward was not faster run F.linear
                for p, keep in zip(s["paths"], mp["whole_model"]["kept"]):
                    assert keep or p == "linear"
        assert mp["extra_bytes"] == cp.installed_bytes(m)
        path = atomic_write_json(tmp_path / "prof.json", prof)
        load_profile(str(path))
        table = load_matmul_paths(path)
        assert table.rows == (1, 2, 3, 8)
        from profiler.plot import plot_profile

        plot_profile(prof, tmp_path / "prof.png")  # the check's points and the chosen rows go on the plot
        assert (tmp_path / "prof.png").stat().st_size > 0
        off = profile_model(m, [1, 2], context_length=8, time_budget_s=1, min_repeats=2, max_repeats=2,
                            progress=False, overhead=False, matmul_paths="off")
        assert "matmul_paths" not in off and cp.installed_bytes(m) == 0
    finally:
        cp.remove_paths(m)


def test_decode_cli_runs_the_profile_paths(tmp_path, capsys):
    from test_decoder_utils import ppd_tree as tree_of

    from decoder.engines.hf.load import load_model
    from planner.tree import save_tree
    from workflows.cli.main import main

    tiny = load_model("tiny", device="cpu").model
    prof = tmp_path / "prof.json"
    atomic_write_json(prof, {"input_lengths": [1, 2], "latency_s": [0.01, 0.02], "dtype": "fp32",
                             "matmul_paths": _table_json(tiny, list(range(1, 12)), lambda M, s: ROTATE[M % 4])})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "Hello there"}\n')
    plan = save_tree(tree_of(2, [0, 3, 6]), tmp_path / "ppd.json")
    out = tmp_path / "out.json"
    args = ["decode", "--plan", str(plan), "--model", "tiny", "--random-prompt-tokens", "2", "--prompts", str(prompts),
            "--max-new-tokens", "10", "--compare-plain", "--no-progress", "-o", str(out)]
    assert main(args + ["--profile", str(prof)]) == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["identical_to_plain"] is True and doc["matmul_paths_profile"] == str(prof)
    bad = json.loads(prof.read_text())
    bad["matmul_paths"]["rows"] = "all"
    prof.write_text(json.dumps(bad))
    assert main(args + ["--profile", str(prof)]) != 0
    assert "field 'matmul_paths.rows'" in capsys.readouterr().err


def _all_rows(model, path="t"):
    return matmul_paths_from_json(_table_json(model, list(range(1, 24)), lambda M, s: path if M % 2 else "onednn"))


def test_new_weights_rebuild_the_layouts():
    """load_state_dict, an in-place edit, a replaced parameter: the paths compute with the new weights
    (their transposed / packed copies are rebuilt); writes through .data need refresh_paths."""
    m, other = tiny_model("llama", seed=2), tiny_model("llama", seed=3)
    ids = torch.tensor([5, 9, 2, 7])
    want = generate(other, ids, max_new_tokens=12).tokens.tolist()
    cp.install_paths(m, _all_rows(m))
    assert generate(m, ids, max_new_tokens=12).tokens.tolist() != want  # two different models
    m.load_state_dict(other.state_dict())
    assert generate(m, ids, max_new_tokens=12).tokens.tolist() == want == reference(other, ids, 12)
    lin = m.model.layers[0].mlp.up_proj
    x = torch.randn(1, 3, lin.in_features)
    with torch.no_grad():
        lin.weight.mul_(0.5)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
    lin.weight = torch.nn.Parameter(torch.randn_like(lin.weight))
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
        lin.weight.data.mul_(2.0)  # invisible to the version counter ...
        assert not torch.allclose(lin(x), torch.nn.functional.linear(x, lin.weight))
        cp.refresh_paths(m)  # ... until refreshed
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight), rtol=1e-5, atol=1e-5)


def test_another_dtype_falls_back_to_f_linear_and_back_again():
    """A table measured in fp32 on a model moved to bf16: F.linear (no stale fp32 copies, no error);
    moved back to fp32: the paths again."""
    m = tiny_model("llama", seed=4)
    ids = torch.tensor([3, 8, 1])
    bare = tiny_model("llama", seed=4).to(torch.bfloat16)
    cp.install_paths(m, _all_rows(m))
    assert cp.installed_bytes(m) > 0
    m.to(torch.bfloat16)
    got = generate(m, ids, max_new_tokens=12).tokens.tolist()
    assert got == generate(bare, ids, max_new_tokens=12).tokens.tolist()
    assert cp.installed_bytes(m) == 0  # every Linear fell back and let its fp32 copies go
    tree_out = generate(m, ids, plan=static_tree("medusa", 6, 2), guesser=PromptTokens.random(m, 2, seed=0, top_k=4),
                        max_new_tokens=12)
    assert tree_out.tokens.tolist() == got
    m.to(torch.float32)  # the bf16-rounded weights, in fp32 again
    assert generate(m, ids, max_new_tokens=12).tokens.tolist() == reference(bare.to(torch.float32), ids, 12)
    assert cp.installed_bytes(m) > 0  # rebuilt on the first call
