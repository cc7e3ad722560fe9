"""Profiler: option parsing, model presets and loading, the profile file, OOM / Ctrl-C / bad input, the fit."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from decoder.engines.hf import timer as hf_timer
from decoder.engines.hf.load import load_model
from decoder.engines.models import preset_names
from planner.errors import UserError
from planner.profile import load_profile
from profiler import measure
from profiler.fit import fit_latency, interpolate, isotonic
from profiler.lengths import parse_lengths
from profiler.measure import default_input_lengths, median_rel_ci, profile_model
from workflows.cli.cmd_profile import parse_batch_sizes
from workflows.cli.main import build_parser, main

torch.set_num_threads(1)

SMALL = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 128,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}
QUICK = dict(time_budget_s=2.0, min_repeats=2, max_repeats=3, warmup=1, progress=False)


@pytest.fixture
def small_config(tmp_path):
    path = tmp_path / "small" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(SMALL))
    return path


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "config.json"
    path.write_text(json.dumps(SMALL))
    return load_model(str(path), device="cpu")


# ---------------------------------------------------------------- option parsing


@pytest.mark.parametrize("spec,expected", [
    ("1,2,4,8", [1, 2, 4, 8]),
    ("8,4,4,1", [1, 4, 8]),
    ("3:6", [3, 4, 5, 6]),
    ("1:17:8", [1, 9, 17]),  # stop inclusive when reached
    ("1:20:8", [1, 9, 17]),  # ... and never passed
    ("5:5", [5]),
    (" 1:3 , 10 ", [1, 2, 3, 10]),
    ("1:4,3:9:3", [1, 2, 3, 4, 6, 9]),
])
def test_parse_lengths(spec, expected):
    assert parse_lengths(spec) == expected


def test_parse_lengths_range_matches_python_range():
    assert parse_lengths("1:512:8") == list(range(1, 513, 8))
    assert parse_lengths("1:16,32:256:16") == list(range(1, 17)) + list(range(32, 257, 16))


@pytest.mark.parametrize("spec", ["", "a", "0", "-1", "5:3", "1:4:0", "1:2:3:4", "1.5", "1,,2", "1:"])
def test_parse_lengths_rejects(spec):
    with pytest.raises(UserError, match="--input-lengths: cannot parse"):
        parse_lengths(spec)


def test_default_lengths_cover_1_to_256_densely():
    n = default_input_lengths()
    assert n[0] == 1 and n[-1] == 256 and np.all(np.diff(n) > 0)
    assert n[:32] == list(range(1, 33)) and max(np.diff(n)) <= 8 and len(n) >= 64


def test_parse_batch_sizes():
    assert parse_batch_sizes(["1", "4"]) == [1, 4]
    assert parse_batch_sizes(["1,4", "2", "4"]) == [1, 4, 2]
    for bad in (["0"], ["x"], ["1,-2"]):
        with pytest.raises(UserError, match="--batch-sizes"):
            parse_batch_sizes(bad)
    from workflows.cli.main import build_parser

    for flag in ("--batch-sizes", "--batch-size"):  # the spelling, and the singular kept for old scripts
        args = build_parser().parse_args(["profile", flag, "1,2,4,8", "-o", "x.json"])
        assert parse_batch_sizes(args.batch_size) == [1, 2, 4, 8]


def test_every_option_parses():
    a = build_parser().parse_args([
        "profile", "--model", "vicuna-7b", "--device", "cuda:1", "--dtype", "bf16", "--context-length", "512",
        "--input-lengths", "1:64", "--batch-size", "1", "4", "--time-budget", "7.5", "--min-repeats", "3",
        "--max-repeats", "9", "--target-ci", "0.05", "--warmup", "4", "--cuda-graphs", "--threads", "2", "--attention", "tree",
        "--seed", "7", "--plot", "x.png", "-o", "out.json", "--no-progress",
    ])
    assert (a.model, a.device, a.dtype, a.context_length, a.input_lengths) == ("vicuna-7b", "cuda:1", "bf16", 512, "1:64")
    assert (a.batch_size, a.time_budget, a.min_repeats, a.max_repeats, a.target_ci) == (["1", "4"], 7.5, 3, 9, 0.05)
    assert (a.warmup, a.cuda_graphs, a.threads, a.seed, a.plot, a.output, a.no_progress) == (4, True, 2, 7, "x.png", "out.json", True)
    assert a.attention == "tree" and build_parser().parse_args(["profile"]).attention == "sdpa"
    d = build_parser().parse_args(["profile"])
    assert (d.model, d.device, d.dtype, d.context_length, d.batch_size, d.cuda_graphs) == (None, None, None, 256, ["1"], False)


@pytest.mark.parametrize("argv", [["--context-length", "0"], ["--dtype", "fp8"], ["--time-budget", "-1"], ["--warmup", "x"]])
def test_bad_option_values_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["profile", *argv])
    assert e.value.code == 2


# ---------------------------------------------------------------- models


def llama_params(c: dict) -> int:
    """Parameter count of a Llama/Qwen2 config, computed from the architecture (independent of transformers)."""
    h, i, L, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    hd = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    attn = h * h + 2 * h * kv + h * h + (h + 2 * kv if c["model_type"] == "qwen2" else 0)  # q,k,v,o (+ qkv bias)
    per_layer = attn + 3 * h * i + 2 * h
    return v * h * (1 if c.get("tie_word_embeddings") else 2) + L * per_layer + h


def test_presets_build_on_meta_with_published_sizes():
    from decoder.engines.models import PRESET_DIR

    names = preset_names()
    for required in ("tiny", "builtin", "llama-2-7b", "vicuna-7b", "vicuna-13b", "mobilellama-1.4b", "qwen2-0.5b", "qwen2-7b"):
        assert required in names
    published = {"llama-2-7b": 6.74e9, "vicuna-7b": 6.74e9, "vicuna-13b": 13.0e9, "mobilellama-1.4b": 1.36e9,
                 "qwen2-0.5b": 0.494e9, "qwen2-7b": 7.62e9}
    for name, size in published.items():
        lm = load_model(name, device="meta")
        count = sum(p.numel() for p in lm.model.parameters())
        assert count == llama_params(json.loads((PRESET_DIR / f"{name}.json").read_text()))
        assert abs(count - size) / size < 0.01, name
        assert lm.source == "preset" and not lm.has_weights and lm.tokenizer_dir is None
        assert all(p.device.type == "meta" for p in lm.model.parameters())


def test_random_weight_model_is_finite_with_unit_norms():
    lm = load_model("tiny", device="cpu")
    m = lm.model
    assert lm.name == "tiny" and len(lm.config_hash) == 16
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert torch.equal(m.model.norm.weight, torch.ones_like(m.model.norm.weight))
    w = m.model.layers[0].mlp.up_proj.weight
    assert 0.01 < w.std().item() < 0.03  # the configured init scale, not zeros or garbage
    with torch.inference_mode():
        logits = m(torch.arange(16)[None]).logits
    assert torch.isfinite(logits).all()


def test_config_hash_depends_on_architecture_only(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(SMALL))
    b.write_text(json.dumps(dict(SMALL, _name_or_path="elsewhere", torch_dtype="float16")))
    c = tmp_path / "c.json"
    c.write_text(json.dumps(dict(SMALL, num_hidden_layers=3)))
    ha, hb, hc = (load_model(str(p), device="meta").config_hash for p in (a, b, c))
    assert ha == hb != hc


def test_load_config_file_and_weights_dir(small_config, tmp_path):
    lm = load_model(str(small_config), device="cpu")
    assert (lm.source, lm.name, lm.has_weights) == ("config", "small", False)
    d = tmp_path / "withweights"
    lm.model.save_pretrained(d)
    loaded = load_model(str(d), device="cpu")
    assert loaded.source == "dir" and loaded.has_weights and loaded.name == "withweights"
    for (k, p), q in zip(lm.model.state_dict().items(), loaded.model.state_dict().values()):
        assert torch.equal(p, q), k


@pytest.mark.parametrize("spec,match", [
    ("no-such-preset", "unknown model preset 'no-such-preset'"),
    ("missing/config.json", "file not found"),
])
def test_load_model_errors(spec, match):
    with pytest.raises(UserError, match=match):
        load_model(spec, device="meta")


def test_load_model_bad_files(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no config.json"):
        load_model(str(tmp_path / "empty"), device="meta")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_model(str(bad), device="meta")
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(UserError, match="'model_type' missing"):
        load_model(str(bad), device="meta")
    with pytest.raises(UserError, match="--dtype"):
        load_model("tiny", device="meta", dtype="fp8")


# ---------------------------------------------------------------- measuring and the file


def test_profile_file_validates_and_loads(small_model, tmp_path):
    from planner.jsonio import atomic_write_json

    lengths = [1, 2, 4, 8, 16, 32]
    prof = profile_model(small_model, lengths, context_length=16, batch_sizes=(1, 2), **QUICK)
    assert prof["input_lengths"] == lengths and prof["batch_size"] == 1 and prof["context_length"] == 16
    assert [s["batch_size"] for s in prof["series"]] == [1, 2]
    for s in prof["series"]:
        assert s["input_lengths"] == lengths and all(r >= 1 for r in s["repeats"])
        assert all(a <= m <= b for a, m, b in zip(s["p10_s"], s["latency_s"], s["p90_s"]))
        assert s["fit"]["kind"] == "piecewise_linear" and np.all(np.diff(s["fit"]["latency_s"]) >= 0)
    for key in ("device", "device_name", "model", "config_hash", "dtype", "versions", "threads", "date", "settings"):
        assert key in prof
    assert prof["device"] == "cpu" and prof["dtype"] == "fp32" and prof["threads"] == 1 and "incomplete" not in prof
    assert prof["versions"]["torch"] == torch.__version__
    path = atomic_write_json(tmp_path / "p.json", prof)
    lp = load_profile(str(path))
    assert list(lp.input_lengths) == lengths and np.allclose(lp.latency_s, prof["fit"]["latency_s"])
    assert lp.source["model"] == small_model.name and lp.source["batch_size"] == 1


def test_latency_at_256_not_below_latency_at_1_on_default_model():
    lm = load_model("tiny", device="cpu")
    prof = profile_model(lm, [1, 256], context_length=256, time_budget_s=6, min_repeats=5, max_repeats=7, progress=False)
    assert prof["latency_s"][1] > prof["latency_s"][0]


def test_length_beyond_max_position(small_model):
    with pytest.raises(UserError, match="exceeds the model's maximum position.*longest allowed 256"):
        profile_model(small_model, [1, 300], context_length=256, **QUICK)


def _oom_at(n_min: int):
    real = hf_timer.tree_forward

    def fake(model, input_ids, position_ids, attention_mask, cache, **kw):
        if input_ids.shape[1] >= n_min:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, input_ids, position_ids, attention_mask, cache, **kw)

    return fake


def test_oom_keeps_shorter_lengths(small_model, monkeypatch):
    monkeypatch.setattr(hf_timer, "tree_forward", _oom_at(16))
    prof = profile_model(small_model, [1, 4, 8, 16, 32], context_length=8, **QUICK)
    assert prof["input_lengths"] == [1, 4, 8]
    assert prof["incomplete"] == [{"reason": "out of memory", "batch_size": 1, "input_length": 16}]


def test_oom_at_every_length_is_an_error(small_model, monkeypatch):
    monkeypatch.setattr(hf_timer, "tree_forward", _oom_at(1))
    with pytest.raises(UserError, match="out of memory at input length 1"):
        profile_model(small_model, [1, 2], context_length=8, **QUICK)


def test_cpu_allocator_failure_counts_as_oom():
    assert measure.is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"))
    assert not measure.is_oom(RuntimeError("shape mismatch"))


def test_ctrl_c_keeps_points_measured(small_model, monkeypatch):
    real, calls = hf_timer.tree_forward, []

    def fake(*a, **kw):
        calls.append(1)
        if len(calls) > 12:  # past the warm-up sweep and into the timed rounds
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(hf_timer, "tree_forward", fake)
    prof = profile_model(small_model, [1, 2, 4, 8], context_length=8, time_budget_s=60, min_repeats=50,
                         max_repeats=50, warmup=1, progress=False)
    assert prof["input_lengths"] and prof["incomplete"][-1]["reason"] == "interrupted"
    assert sum(prof["repeats"]) == 12 - 4


def test_median_ci_shrinks_with_samples():
    rng = np.random.default_rng(0)
    assert median_rel_ci([1.0]) == float("inf")
    few, many = rng.normal(1, 0.05, 10).tolist(), rng.normal(1, 0.05, 400).tolist()
    assert median_rel_ci(many) < median_rel_ci(few) and median_rel_ci(many) < 0.02
    assert median_rel_ci([2.0] * 9) == 0.0


# ---------------------------------------------------------------- CLI end to end


def test_cli_writes_profile_and_plot(small_config, tmp_path, capsys):
    out, png = tmp_path / "prof.json", tmp_path / "prof.png"
    rc = main(["profile", "--model", str(small_config), "--input-lengths", "1:8,16", "--context-length", "8",
               "--time-budget", "1", "--max-repeats", "3", "--threads", "1", "--no-progress", "-o", str(out), "--plot", str(png)])
    assert rc == 0
    assert load_profile(str(out)).max_input_length == 16
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*.tmp"))


def test_cli_tree_attention_kernels(small_config, tmp_path):
    out = tmp_path / "prof.json"
    rc = main(["profile", "--model", str(small_config), "--attention", "tree", "--input-lengths", "1,5,21",
               "--context-length", "8", "--time-budget", "1", "--no-progress", "-o", str(out)])
    assert rc == 0
    prof = json.loads(out.read_text())
    assert prof["settings"]["attn_implementation"] == "tree_triton" and prof["input_lengths"] == [1, 5, 21]


def test_list_models(capsys):
    assert main(["profile", "--list-models"]) == 0
    assert "llama-2-7b" in capsys.readouterr().out.split()


def test_cli_default_output_name(small_config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main(["profile", "--model", str(small_config), "--input-lengths", "1,2", "--context-length", "4",
               "--time-budget", "1", "--no-progress"])
    assert rc == 0 and (tmp_path / "profiles" / "cpu-small.json").is_file()


@pytest.mark.parametrize("argv,match", [
    (["--model", "nope"], "unknown model preset 'nope'"),
    (["--input-lengths", "1:x"], "--input-lengths: cannot parse '1:x'"),
    (["--model", "tiny", "--input-lengths", "1:2000"], "exceeds the model's maximum position"),
    (["--batch-size", "0"], "--batch-size"),
    (["--device", "tpu"], "--device: expected cpu, cuda or cuda:N"),
    (["--device", "cpu", "--cuda-graphs"], "--cuda-graphs: needs a CUDA device"),
    (["--plot", "x.pdf"], "--plot: expected a .png"),
    (["-o", "{tmp}/afile/p.json"], "afile/p.json: cannot write there"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(argv, match, tmp_path, capsys):
    out = tmp_path / "p.json"
    (tmp_path / "afile").write_text("")
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["profile", "--no-progress", "-o", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("planner profile: error: ") and match in err[0]
    assert not out.exists()


def test_cli_oom_keeps_points_and_says_where(small_config, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(hf_timer, "tree_forward", _oom_at(8))
    out = tmp_path / "p.json"
    rc = main(["profile", "--model", str(small_config), "--input-lengths", "1,2,4,8,16", "--context-length", "4",
               "--time-budget", "1", "--no-progress", "-o", str(out)])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("planner profile: error: out of memory at input length 8 (batch size 1")
    assert str(out) in err and "kept the 3 points" in err
    assert list(load_profile(str(out)).input_lengths) == [1, 2, 4]


# ---------------------------------------------------------------- the fit


def isotonic_minmax(y, w):
    """Independent characterisation: f_i = max_{j<=i} min_{k>=i} weighted mean of y[j..k]."""
    m = len(y)
    return np.array([max(min(np.dot(w[j:k + 1], y[j:k + 1]) / w[j:k + 1].sum() for k in range(i, m))
                         for j in range(i + 1)) for i in range(m)])


def test_isotonic_matches_minmax_formula():
    rng = np.random.default_rng(1)
    for _ in range(50):
        m = int(rng.integers(1, 12))
        y, w = rng.normal(size=m).cumsum() + rng.normal(size=m), rng.uniform(0.5, 3, m)
        np.testing.assert_allclose(isotonic(y, w), isotonic_minmax(y, w), rtol=1e-12, atol=1e-12)
    y = np.array([1.0, 2.0, 2.0, 5.0])
    np.testing.assert_array_equal(isotonic(y), y)  # already monotone: unchanged


def test_fit_interpolates_and_planner_reads_it(tmp_path):
    from planner.jsonio import atomic_write_json

    fit = fit_latency([1, 2, 4, 8], [1.0, 3.0, 2.0, 5.0], repeats=[1, 1, 1, 2])
    assert fit["latency_s"] == [1.0, 2.5, 2.5, 5.0]
    assert interpolate(fit, 6) == pytest.approx(3.75) and interpolate(fit, 2) == pytest.approx(2.5)
    path = atomic_write_json(tmp_path / "p.json", {"input_lengths": [1, 2, 4, 8], "latency_s": [1.0, 3.0, 2.0, 5.0], "fit": fit})
    lp = load_profile(str(path))
    assert lp.latency(6) == pytest.approx(3.75) and lp.latency(3) == pytest.approx(2.5)
    with pytest.raises(UserError, match="outside the profiled range"):
        lp.latency(9)


def test_budget_running_out_in_round_one_still_spans_the_range(small_model, monkeypatch):
    import time

    real = hf_timer.tree_forward

    def slow(*a, **kw):
        time.sleep(0.05)
        return real(*a, **kw)

    monkeypatch.setattr(hf_timer, "tree_forward", slow)
    prof = profile_model(small_model, list(range(1, 10)), context_length=8, time_budget_s=0.25, warmup=1, progress=False)
    assert prof["input_lengths"][0] == 1 and prof["input_lengths"][-1] == 9 and len(prof["input_lengths"]) < 9
    unmeasured = prof["unmeasured_input_lengths"]["1"]
    assert sorted(unmeasured + prof["input_lengths"]) == list(range(1, 10))


def test_oom_in_later_rounds_keeps_samples(small_model, monkeypatch):
    real, calls = hf_timer.tree_forward, {"n": 0}

    def fake(model, input_ids, *a, **kw):
        calls["n"] += 1
        if calls["n"] > 8 and input_ids.shape[1] >= 4:  # fits in round one, fails later (fragmentation)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return real(model, input_ids, *a, **kw)

    monkeypatch.setattr(hf_timer, "tree_forward", fake)
    prof = profile_model(small_model, [1, 2, 4, 8], context_length=8, time_budget_s=2, min_repeats=3, max_repeats=3,
                         warmup=1, progress=False)
    assert prof["input_lengths"] == [1, 2, 4, 8] and prof["incomplete"][0]["input_length"] == 4
    assert prof["repeats"][:2] == [3, 3] and all(r >= 1 for r in prof["repeats"][2:])


def test_runner_resets_to_the_prefix(small_model):
    from decoder.torch_ops.forward import prefill

    cache = prefill(small_model.model, torch.arange(8)[None]).cache
    runner = hf_timer.Runner(small_model.model, cache, cuda_graphs=False)
    x = hf_timer.make_tree_input(5, 1, 8, 128, torch.float32, "cpu", torch.Generator().manual_seed(0))
    assert x.mask.shape == (1, 1, 5, 13) and x.position_ids.tolist() == [[8, 9, 9, 9, 9]]
    runner.warm(5, x, 2)
    assert cache.get_seq_length() == 13
    runner.sample_fn(5, x)()
    runner.reset()
    assert cache.get_seq_length() == 8 and cache.layers[0].keys is runner.prefix[0][0]


def test_cli_ctrl_c_writes_points_and_exits_130(small_config, tmp_path, monkeypatch, capsys):
    real, calls = hf_timer.tree_forward, []

    def fake(*a, **kw):
        calls.append(1)
        if len(calls) > 10:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(hf_timer, "tree_forward", fake)
    out = tmp_path / "p.json"
    rc = main(["profile", "--model", str(small_config), "--input-lengths", "1:4", "--context-length", "4",
               "--time-budget", "60", "--min-repeats", "50", "--no-progress", "-o", str(out)])
    assert rc == 130
    assert "interrupted: kept the points measured so far" in capsys.readouterr().err
    prof = json.loads(out.read_text())
    assert prof["input_lengths"] == [1, 2, 3, 4] and prof["incomplete"][-1]["reason"] == "interrupted"
