"""`planner export`: every engine's output parses and holds the engine's keys with values in their
documented ranges; what an engine cannot express is noted; bad inputs are one-line errors."""
import json
import shlex
import subprocess
import sys

import pytest
import yaml

from planner.errors import UserError
from planner.export import (
    DraftRange,
    ExportOptions,
    build,
    ranges_from_depths,
    resolve_method,
)
from planner.jsonio import to_yaml
from planner.plan import SHARED_DIR
from planner.vllm_plugin import PLUGIN_ENV, needs_plugin, vllm_serving
from planner.tree import SCHEMA_PATH, load_tree
from workflows.cli.main import main

PUBLISHED = SHARED_DIR / "data" / "published_acceptance.json"
MEDUSA = f"{PUBLISHED}:medusa-vicuna-7b"
PPD = f"{PUBLISHED}:ppd-vicuna-7b"
SERIES = [  # flat to fewer tokens per row as the batch grows: 5-deep chains at 1, shorter above, none at 64
    {"batch_size": 1, "input_lengths": [1, 24, 256], "latency_s": [0.02, 0.02, 0.1]},
    {"batch_size": 4, "input_lengths": [1, 8, 256], "latency_s": [0.022, 0.024, 0.3]},
    {"batch_size": 16, "input_lengths": [1, 2, 256], "latency_s": [0.03, 0.045, 1.2]},
    {"batch_size": 64, "input_lengths": [1, 256], "latency_s": [0.05, 12.8]},
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    profile = d / "profile.json"
    profile.write_text(json.dumps(dict(SERIES[0], series=SERIES)))
    flat = d / "flat.json"
    flat.write_text(json.dumps(SERIES[0]))
    batched, single = d / "batched.json", d / "single.json"
    assert main(["plan", "medusa", "--accept", MEDUSA, "--profile", str(profile), "--batch-sizes", "1,4,16,64",
                 "--max-size", "30", "-q", "-o", str(batched)]) == 0
    assert main(["plan", "medusa", "--accept", MEDUSA, "--profile", str(flat), "--max-size", "30", "-q",
                 "-o", str(single)]) == 0
    return {"dir": d, "batched": batched, "single": single, "profile": profile}


def export(files, tmp_path, engine, plan="batched", *extra, name=None):
    out = tmp_path / (name or f"{engine}.json")
    rc = main(["export", "--engine", engine, str(files[plan]), "-o", str(out), *map(str, extra)])
    return rc, out


def _check_common(data, engine, err):
    assert data["format"] == "tree-planner/export" and data["engine"] == engine
    notes = data["notes"]
    assert notes and all(isinstance(n, str) and "\n" not in n for n in notes)
    assert [line for line in err.splitlines() if line.startswith("note: ")] == [f"note: {n}" for n in notes]
    basis = data["basis"]
    assert basis["acceptance"]["name"] == "medusa-vicuna-7b" and basis["profile"]["sha256"]
    nodes = [tuple(p) for p in basis["tree_at_batch_size_1"][0]["nodes"]]
    assert nodes and all(p[:-1] in set(nodes) | {()} for p in nodes)  # every prefix of the written tree present
    return basis


def _check_ranges(ranges, k_max):
    assert ranges[0][0] == 1
    for (lo, hi, k), nxt in zip(ranges, ranges[1:] + [None]):
        assert lo <= hi and 0 <= k <= k_max
        if nxt is not None:
            assert nxt[0] == hi + 1  # ordered, non-overlapping, no gaps


def test_vllm(files, tmp_path, capsys):
    rc, out = export(files, tmp_path, "vllm", "batched", "--method", "eagle3", "--draft-model", "EAGLE3-8B")
    assert rc == 0
    data = json.loads(out.read_text())
    basis = _check_common(data, "vllm", capsys.readouterr().err)
    cfg = data["speculative_config"]
    assert cfg["method"] == "eagle3" and cfg["model"] == "EAGLE3-8B"
    k_max = cfg["num_speculative_tokens"]
    assert isinstance(k_max, int) and k_max > 0
    ranges = cfg["num_speculative_tokens_per_batch_size"]
    _check_ranges(ranges, k_max)
    assert max(k for _, _, k in ranges) == k_max and ranges[-1][2] == 0 and ranges[-1][1] == 4096
    assert [k for _, _, k in ranges] == sorted((k for _, _, k in ranges), reverse=True)
    assert any("tree dropped" in n for n in data["notes"])
    # a K = 0 range: served with the project's vLLM plugin, its switch beside the config and on the command line
    assert data["env"] == {PLUGIN_ENV: "1"}
    words = shlex.split(data["command_line"])
    assert words[:4] == [f"{PLUGIN_ENV}=1", "vllm", "serve", "MODEL"] and words[4] == "--speculative-config"
    assert json.loads(words[5]) == cfg and len(words) == 6
    note = next(n for n in data["notes"] if "plugin" in n)
    assert "pip install ./vllm_plugin" in note and "0.82-0.97x vLLM plain" in note
    assert [r["batch_size"] for r in basis["per_batch_size"]] == [1, 4, 16, 64]
    assert all("chain_predicted_speedup" in r for r in basis["per_batch_size"])


def test_vllm_ngram_and_single_range(files, tmp_path):
    rc, out = export(files, tmp_path, "vllm", "single", "--method", "ngram", "--ngram-min", 2, "--ngram-max", 4)
    assert rc == 0
    cfg = json.loads(out.read_text())["speculative_config"]
    assert cfg["method"] == "ngram" and "model" not in cfg and "num_speculative_tokens_per_batch_size" not in cfg
    assert cfg["num_speculative_tokens"] >= 1 and (cfg["prompt_lookup_min"], cfg["prompt_lookup_max"]) == (2, 4)
    data = json.loads(out.read_text())
    assert "env" not in data and shlex.split(data["command_line"])[0] == "--speculative-config"  # no plugin needed


def test_vllm_plugin_off_writes_what_stock_vllm_runs(files, tmp_path):
    rc, out = export(files, tmp_path, "vllm", "batched", "--method", "ngram", "--plugin", "off")
    assert rc == 0
    data = json.loads(out.read_text())
    assert "env" not in data and [k for _, _, k in data["speculative_config"]["num_speculative_tokens_per_batch_size"]][-1] == 0
    flag, value = shlex.split(data["command_line"])
    assert flag == "--speculative-config" and json.loads(value) == data["speculative_config"]
    assert any("K = 0 ranges run vLLM's speculative path" in n and "--plugin off" in n for n in data["notes"])


@pytest.mark.parametrize("method", ["suffix", "medusa"])
def test_vllm_one_length_proposers_take_a_schedule_with_the_plugin(method):
    plan = load_tree(SCHEMA_PATH.parent / "medusa-vicuna-7b-n63.json")
    ranges = [DraftRange(1, 4, 3), DraftRange(5, 8, 1), DraftRange(9, 4096, 0)]
    with_plugin = build(plan, ranges, ExportOptions("vllm", method, "M"), {}, [])
    assert with_plugin.settings["speculative_config"]["num_speculative_tokens_per_batch_size"] == [
        [1, 4, 3], [5, 8, 1], [9, 4096, 0]]
    assert with_plugin.settings["env"] == {PLUGIN_ENV: "1"}
    assert any("asserts one draft length" in n for n in with_plugin.notes)  # what happens without it
    stock = build(plan, ranges, ExportOptions("vllm", method, "M", plugin=False), {}, [])
    cfg = stock.settings["speculative_config"]
    assert "num_speculative_tokens_per_batch_size" not in cfg and cfg["num_speculative_tokens"] == 3
    assert "env" not in stock.settings and any("drop --plugin off" in n for n in stock.notes)
    # one length for every batch size needs no plugin
    single = build(plan, [DraftRange(1, 4096, 2)], ExportOptions("vllm", method, "M"), {}, [])
    assert "env" not in single.settings and single.command_line.startswith("--speculative-config ")


def test_which_vllm_configs_need_the_plugin():
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    assert not needs_plugin(None) and not needs_plugin(ngram)
    assert needs_plugin(dict(ngram, num_speculative_tokens_per_batch_size=[[1, 4, 4], [5, 256, 0]]))
    assert not needs_plugin(dict(ngram, num_speculative_tokens_per_batch_size=[[1, 4, 4], [5, 256, 2]]))
    assert needs_plugin({"method": "suffix", "num_speculative_tokens_per_batch_size": [[1, 4, 8], [5, 256, 2]]})
    mtp = {"method": "mtp", "num_speculative_tokens": 1, "num_speculative_tokens_per_batch_size": [[1, 4, 1], [5, 9, 0]]}
    assert not needs_plugin(mtp)  # the plugin does not act for mtp: no switch, a note on the cost instead
    env, line, notes = vllm_serving(mtp)
    assert env == {} and line.startswith("--speculative-config ") and "does not act for mtp" in notes[0]
    assert len(notes) == 1  # no sampled note where the plugin does not act
    env, line, notes = vllm_serving(ngram)  # needs no switch greedy; sampled on vLLM's CPU build it does
    assert env == {} and "TREE_PLANNER_VLLM_PLUGIN=1" in notes[-1] and "uninitialised temperature" in notes[-1]


def test_sglang_adaptive(files, tmp_path, capsys):
    rc, out = export(files, tmp_path, "sglang", "batched", "--method", "eagle", "--draft-model", "DRAFT")
    assert rc == 0
    data = json.loads(out.read_text())
    _check_common(data, "sglang", capsys.readouterr().err)
    args = data["server_args"]
    flags = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--") and not args[i + 1].startswith("--")}
    steps, topk, tokens = (int(flags[f"--speculative-{k}"]) for k in ("num-steps", "eagle-topk", "num-draft-tokens"))
    assert steps >= 1 and topk == 1 and tokens == steps + 1 and flags["--speculative-algorithm"] == "EAGLE"
    assert "--speculative-adaptive" in args
    adaptive_file = out.with_name("sglang.adaptive.json")
    assert flags["--speculative-adaptive-config"] == str(adaptive_file)
    adaptive = json.loads(adaptive_file.read_text())
    assert adaptive == data["adaptive_config"]
    keys = [int(k) for k in adaptive]
    assert keys[0] == 1 and keys == sorted(set(keys)) and all(k == str(int(k)) for k in adaptive)
    steps_by_range = [v["candidate_steps"] for v in adaptive.values()]
    assert all(len(s) == 1 and isinstance(s[0], int) and s[0] >= 0 for s in steps_by_range)
    assert steps_by_range[-1] == [0] and any("candidate_steps [0]" in n for n in data["notes"])
    assert shlex.split(data["command_line"]) == args


def test_sglang_static_tree(files, tmp_path):
    rc, out = export(files, tmp_path, "sglang", "single", "--method", "eagle3", "--draft-model", "DRAFT")
    assert rc == 0
    data = json.loads(out.read_text())
    args = data["server_args"]
    steps, topk, tokens = (int(args[args.index(f"--speculative-{k}") + 1])
                           for k in ("num-steps", "eagle-topk", "num-draft-tokens"))
    tree = load_tree(files["single"])
    assert (steps, tokens) == (tree.depth, len(tree.states[0].nodes) + 1)
    assert topk == 1 + max(r for p in tree.states[0].nodes for r in p) and data["adaptive_config"] is None
    assert any("tree shape dropped" in n for n in data["notes"])
    assert not out.with_name("sglang.adaptive.json").exists()


def test_trtllm_yaml_schedule(files, tmp_path, capsys):
    rc, out = export(files, tmp_path, "trtllm", "batched", "--method", "eagle3", "--draft-model", "DRAFT",
                     name="trtllm.yaml")
    assert rc == 0
    err = capsys.readouterr().err
    text = out.read_text()
    cfg = yaml.safe_load(text)["speculative_config"]
    assert set(yaml.safe_load(text)) == {"speculative_config"}  # engine-ready: nothing else at top level
    assert cfg["decoding_type"] == "Eagle3" and cfg["speculative_model"] == "DRAFT"
    k_max = cfg["max_draft_len"]
    assert k_max >= 1 and cfg["max_total_draft_tokens"] == k_max  # chains
    schedule = cfg["draft_len_schedule"]
    keys = list(schedule)
    assert all(isinstance(k, int) for k in keys) and keys == sorted(set(keys)) and keys[0] >= 1
    assert schedule[keys[0]] == k_max and all(0 <= v <= k_max for v in schedule.values())
    assert keys[-1] < 64  # plain from batch size 64 on: the implicit 0 above the largest key
    comments = [line[2:] for line in text.splitlines() if line.startswith("# ")]
    notes = [c[len("note: "):] for c in comments if c.startswith("note: ")]
    assert notes and [line for line in err.splitlines() if line.startswith("note: ")] == [f"note: {n}" for n in notes]
    assert any(c.startswith("basis batch size 64: draft length 0") for c in comments)
    assert any(c.startswith("basis acceptance: ") for c in comments)


def test_trtllm_takes_the_plans_tree_as_eagle_choices(files, tmp_path):
    """TensorRT-LLM's EagleDecodingConfig takes a static tree as paths (eagle_choices, every prefix present)."""
    rc, out = export(files, tmp_path, "trtllm", "single", "--method", "eagle", "--draft-model", "DRAFT")
    assert rc == 0
    cfg = json.loads(out.read_text())["speculative_config"]
    paths = {tuple(p) for p in cfg["eagle_choices"]}
    assert all(len(p) == 1 or p[:-1] in paths for p in paths) and "use_dynamic_tree" not in cfg
    assert cfg["max_total_draft_tokens"] == len(paths) and cfg["max_draft_len"] == max(map(len, paths))


@pytest.mark.parametrize("method, keys", [
    ("draft_model", {"num_assistant_tokens": int, "num_assistant_tokens_schedule": str}),
    ("ngram", {"prompt_lookup_num_tokens": int, "max_matching_ngram_size": int}),
])
def test_hf(files, tmp_path, method, keys):
    rc, out = export(files, tmp_path, "hf", "batched", "--method", method, "--ngram-max", 3)
    assert rc == 0
    data = json.loads(out.read_text())
    cfg = data["generation_config"]
    assert set(cfg) == set(keys) and all(isinstance(cfg[k], t) for k, t in keys.items())
    k = cfg.get("num_assistant_tokens", cfg.get("prompt_lookup_num_tokens"))
    assert k >= 1 and cfg.get("num_assistant_tokens_schedule", "constant") == "constant"
    assert any("batch sizes above 1 dropped" in n for n in data["notes"])
    assert [r["batch_size"] for r in data["basis"]["per_batch_size"]][0] == 1


def test_without_acceptance_and_profile_the_depths_are_written(files, tmp_path, capsys):
    plan = json.loads(files["batched"].read_text())
    plan["provenance"]["profile"]["file"] = str(tmp_path / "moved.json")
    moved = tmp_path / "moved-plan.json"
    moved.write_text(json.dumps(plan))
    out = tmp_path / "v.json"
    assert main(["export", "--engine", "vllm", str(moved), "--method", "ngram", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    depths = [0 if e.tree is None else e.tree.depth for e in load_tree(moved).schedule]
    merged = [k for i, k in enumerate(depths) if i == 0 or k != depths[i - 1]]
    assert [k for _, _, k in data["speculative_config"]["num_speculative_tokens_per_batch_size"]] == merged
    assert any("is not there" in n for n in data["notes"]) and any("tree depths" in n for n in data["notes"])
    assert any("each range's tree depth" in n for n in data["notes"])
    # given explicitly, they are used again
    assert main(["export", "--engine", "vllm", str(moved), "--method", "ngram", "--accept", MEDUSA,
                 "--profile", str(files["profile"]), "-o", str(out)]) == 0
    assert "chains planned" in json.loads(out.read_text())["basis"]["draft_lengths"]


@pytest.mark.parametrize("argv, message", [
    (["--engine", "tgi", "PLAN"], "--engine: expected one of vllm, sglang, trtllm, hf, got 'tgi'"),
    (["PLAN"], "--engine is required"),
    (["--engine", "vllm", "NOTTREE"], "missing field 'method'"),
    (["--engine", "vllm", "MISSING"], "file not found"),
    (["--engine", "vllm", "PLAN", "--method", "eagle"], "--method eagle on vllm needs --draft-model"),
    (["--engine", "vllm", "PLAN", "--method", "lookahead"], "--method: vllm takes one of"),
    (["--engine", "hf", "PLAN", "--method", "eagle"], "--method: hf takes one of draft_model, ngram"),
    (["--engine", "vllm", "PLAN", "--ngram-min", "4", "--ngram-max", "2"], "--ngram-min 4 is above --ngram-max 2"),
    (["--engine", "vllm", "PLAN", "--max-batch-size", "0"], "--max-batch-size must be in"),
    (["--engine", "sglang", "PLAN", "--method", "medusa"], "--method: sglang takes one of"),
])
def test_bad_inputs_exit_2_with_one_line_and_write_nothing(files, tmp_path, capsys, argv, message):
    not_tree = tmp_path / "not-a-tree.json"
    not_tree.write_text(json.dumps({"accuracy": [[0.5]]}))
    subst = {"PLAN": str(files["batched"]), "NOTTREE": str(not_tree), "MISSING": str(tmp_path / "none.json")}
    out = tmp_path / "out.json"
    assert main(["export", *[subst.get(a, a) for a in argv], "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("planner export: error: ") and err.count("\n") == 1 and message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-a-tree.json"]


def test_ppd_plans_need_an_engine_method():
    with pytest.raises(UserError, match="a ppd plan has no vllm equivalent"):
        resolve_method("vllm", "ppd", None, None)
    assert resolve_method("trtllm", "medusa", None, "M") == "medusa"
    assert resolve_method("hf", "ppd", None, None) == "draft_model"


def test_trtllm_schedule_rules():
    plan = load_tree(SCHEMA_PATH.parent / "medusa-vicuna-7b-n63.json")
    opts = ExportOptions("trtllm", "eagle3", "D")
    out = build(plan, [DraftRange(1, 4, 3), DraftRange(5, 8, 5), DraftRange(9, 32, 0), DraftRange(33, 64, 1)],
                opts, {}, [])
    cfg = out.settings["speculative_config"]
    assert cfg["draft_len_schedule"] == {4: 3, 8: 3, 32: 0, 64: 1} and cfg["max_draft_len"] == 3
    assert "max_concurrency" not in cfg  # speculating again at 33-64: no switch-off above a concurrency
    off = build(plan, [DraftRange(1, 4, 3), DraftRange(5, 64, 0)], opts, {}, []).settings["speculative_config"]
    assert off["draft_len_schedule"] == {4: 3} and off["max_concurrency"] == 4  # TensorRT-LLM's own switch
    assert any("clamped to 3" in n for n in out.notes)
    with pytest.raises(UserError, match="must start at max_draft_len"):
        build(plan, [DraftRange(1, 4, 0), DraftRange(5, 8, 2)], opts, {}, [])
    with pytest.raises(UserError, match="every batch size"):
        build(plan, [DraftRange(1, 4096, 0)], ExportOptions("vllm", "ngram"), {}, [])


def test_depth_ranges_and_yaml_writer():
    plan = load_tree(SCHEMA_PATH.parent / "medusa-vicuna-7b-n63.json")
    assert ranges_from_depths(plan, 4096) == [DraftRange(1, 4096, plan.depth)]
    obj = {"speculative_config": {"decoding_type": "Eagle", "speculative_model": "a: b # c", "use_dynamic_tree": True,
                                  "draft_len_schedule": {4: 4, 8: 2}}}
    text = to_yaml(obj, ["one", "two: three"])
    assert text.startswith("# one\n# two: three\n") and yaml.safe_load(text) == obj


def test_export_does_not_import_torch(files, tmp_path):
    code = (
        "import sys; from workflows.cli.main import main; "
        f"rc = main(['export', '--engine', 'vllm', {str(files['batched'])!r}, '--method', 'ngram', '-q', "
        f"'-o', {str(tmp_path / 'v.json')!r}]); "
        "heavy = [m for m in ('torch', 'transformers', 'optuna', 'matplotlib') if m in sys.modules]; "
        "assert rc == 0 and not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
