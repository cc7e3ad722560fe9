"""`planner accept --engine vllm`: the acceptance of vLLM's own proposers from its speculative-decoding
counters (profiler/vllm_accept.py), and the draft LM as a folder vLLM's draft_model loads
(decoder/engines/vllm/draft_folder.py).

Without vLLM: canned `/metrics` pages and load results turned into acceptance rows checked against a
hand computation; the command's branch with a fake engine and fake server (requests, sampling,
configs, the collection file, nothing written on a failure); the draft folder written from a toy
target and checked, with transformers, to compute the draft LM's own logits.

With vLLM (scripts/setup_vllm.sh; skipped with the reason where it is absent, unless
TREE_PLANNER_REQUIRE_VLLM=1): one server, draft_model with the project's draft LM on SmolLM2, two
short requests: vLLM loads the folder, drafts with it, and accepts some of its tokens (about 1-2
minutes on a 2-core CPU).
"""
from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from decoder.engines.vllm import env as vllm_env
from decoder.engines.vllm.draft_folder import MARKER, served_draft, write_draft_folder
from planner.accept import load_acceptance
from planner.errors import UserError
from planner.sampling import Sampling
from profiler import vllm_accept as va
from profiler.load_generator import LoadResult, RequestRecord
from profiler.serving_metrics import spec_decode_counters
from profiler.workload import Request
from workflows.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = os.environ.get("TREE_PLANNER_REQUIRE_VLLM") == "1"
GREEDY = Sampling(0.0)


def page(drafts, draft_tokens, accepted, per_pos) -> str:
    """A `/metrics` page as vLLM 0.32 writes its speculative-decoding counters (other metrics around them)."""
    lab = 'engine="0",model_name="m"'
    lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
             f"vllm:num_requests_running{{{lab}}} 0.0",
             "# TYPE vllm:spec_decode_num_drafts_total counter", f"vllm:spec_decode_num_drafts_total{{{lab}}} {drafts}",
             f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {draft_tokens}",
             f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {accepted}"]
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{i}"}} {a}'
              for i, a in enumerate(per_pos)]
    return "\n".join(lines) + "\n"


BEFORE = page(5.0, 20.0, 7.0, [4.0, 2.0, 1.0, 0.0])
AFTER = page(45.0, 180.0, 57.0, [34.0, 15.0, 6.0, 2.0])  # this level: 40 drafts, 160 drafted, 50 accepted, [30, 13, 5, 2]


def record(index: int, tokens: int, chunks: int, error: str | None = None) -> RequestRecord:
    times = [0.1 * (i + 1) for i in range(chunks)]
    times += [times[-1]] * (tokens - chunks)  # several tokens in a chunk share its time
    return RequestRecord(index, 0.0, ttft_s=times[0], token_times_s=times, latency_s=times[-1], output_tokens=tokens,
                         error=error)


def level(*records: RequestRecord) -> LoadResult:
    return LoadResult(concurrency=4, wall_s=10.0, records=list(records))


# ---------------------------------------------------------------------------------------------- counts -> acceptance

def test_counts_become_the_chains_conditional_rows_by_hand():
    counters = spec_decode_counters(AFTER) - spec_decode_counters(BEFORE)
    # two requests, 60 and 52 tokens, streamed in 30 and 25 chunks: steps = 112 - 2 - 50 = 60 (chunks: 29 + 24 = 53)
    result = level(record(0, 60, 30), record(1, 52, 25))
    rec = va.acceptance_record("ngram", 4, counters, result, {"method": "ngram"}, GREEDY, "smollm2-135m", "vllm")
    assert [r for (r,) in rec["accuracy"]] == pytest.approx([30 / 60, 13 / 30, 5 / 13, 2 / 5])
    assert rec["counts"] == [[30], [13], [5], [2]] and rec["totals"] == [60, 30, 13, 5] and rec["positions"] == 60
    v = rec["vllm"]
    assert (v["steps"], v["steps_by_tokens"], v["steps_by_chunks"], v["drafts"]) == (60, 60, 53, 40)
    assert v["accepted_per_position"] == [30, 13, 5, 2] and v["draft_rate"] == pytest.approx(40 / 60)
    assert v["per_draft"] == pytest.approx([30 / 40, 13 / 40, 5 / 40, 2 / 40])  # vLLM's own per-position rate
    # the planner's product model gives back the measured tokens per step
    rows = np.array(rec["accuracy"])[:, 0]
    assert 1 + np.cumprod(rows).sum() == pytest.approx(v["tokens_per_step"]) == pytest.approx(1 + 50 / 60)
    assert rec["sampling"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    assert rec["guesser"]["prompt_tokens"] is False and rec["guesser"]["draft_passes"] == "one"


def test_steps_take_the_larger_lower_bound_and_never_fewer_than_drafts():
    counters = spec_decode_counters(AFTER) - spec_decode_counters(BEFORE)  # 50 accepted, 40 drafts
    # last steps accepted past the end: tokens say 70 - 1 - 50 = 19, the stream's 45 chunks say 44
    assert va.decode_steps(level(record(0, 70, 45)).completed, counters) == {
        "steps": 44, "steps_by_tokens": 19, "steps_by_chunks": 44}
    assert va.decode_steps(level(record(0, 60, 10)).completed, counters)["steps"] == 40  # the drafts vLLM counted
    # a failed request counts for nothing
    timed_out = level(record(0, 60, 30), record(1, 52, 25, error="timeout"))
    assert va.decode_steps(timed_out.completed, counters)["steps_by_tokens"] == 9


def test_rows_past_what_was_reached_are_zero_and_bad_counters_refused():
    rows, counts, totals = va.chain_rows([3.0, 0.0], 10, 4)
    assert rows == [[0.3], [0.0], [0.0], [0.0]] and totals == [10, 3, 0, 0] and counts == [[3], [0], [0], [0]]
    with pytest.raises(UserError, match="inconsistent"):
        va.chain_rows([2.0, 5.0], 10, 2)


def test_settings_and_requests():
    assert va.speculative_config("ngram", 8) == {"method": "ngram", "num_speculative_tokens": 8,
                                                 "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert va.speculative_config("suffix", 5) == {"method": "suffix", "num_speculative_tokens": 5}
    assert va.speculative_config("draft_model", 3, "/d") == {"method": "draft_model", "num_speculative_tokens": 3,
                                                             "model": "/d"}
    for bad, match in [(("mtp", 4), "--method mtp"), (("ngram", 0), "--max-depth"), (("draft_model", 4), "--draft-model"),
                       (("eagle3", 4), "--drafter DIR")]:
        with pytest.raises(UserError, match=match):
            va.speculative_config(*bad)
    reqs = [Request([{"role": "user", "content": "hi"}], 16, {"temperature": 0.9, "stop": ["x"]})] * 2
    assert [r.extras for r in va.sampled_requests(reqs, GREEDY)] == [{"stop": ["x"], "temperature": 0.0}] * 2
    sampled = va.sampled_requests(reqs, Sampling(0.7, 20, 0.9), seed=5)
    assert [r.extras for r in sampled] == [{"stop": ["x"], "temperature": 0.7, "seed": 5 + i, "top_k": 20, "top_p": 0.9}
                                          for i in range(2)]
    unseeded = va.sampled_requests(reqs, Sampling(0.7, 20, 0.9), seed=5, seeded=False)
    assert [r.extras for r in unseeded] == [{"stop": ["x"], "temperature": 0.7, "top_k": 20, "top_p": 0.9}] * 2


# ---------------------------------------------------------------------------------------------- the command, faked

class FakeServer:
    """Records what happens to it in `events` as (what, its method)."""
    url, served_model_name = "http://127.0.0.1:9", "m"

    def __init__(self, method, events):
        self.method, self.events = method, events

    def launch(self):
        self.events.append(("launch", self.method))

    def reset_prefix_cache(self, forget_answers=False):
        self.events.append(("reset", self.method, forget_answers))

    def stop(self):
        self.events.append(("stop", self.method))

    def __enter__(self):
        self.events.append(("up", self.method))
        return self

    def __exit__(self, *exc):
        self.stop()


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A vllm engine whose servers are fakes: configs and requests are recorded, every level reads
    BEFORE then AFTER, and the load is `state["level"]`."""
    from planner.engines import kind

    state = {"configs": [], "requests": [], "events": [], "level": level(record(0, 60, 30), record(1, 52, 25))}

    class Engine:
        python, model_dir, model_name, caps = Path(sys.executable), tmp_path, "smollm2-135m", kind("vllm").caps

        def server(self, speculative_config=None, **kw):
            state["configs"].append(speculative_config)
            return FakeServer(speculative_config["method"], state["events"])

    pages = iter([BEFORE, AFTER] * 10)
    monkeypatch.setattr("workflows.cli.engines.open_from_args", lambda args, spec, **kw: Engine())
    monkeypatch.setattr(va, "fetch_spec_decode", lambda url: spec_decode_counters(next(pages)))

    def run_load(url, model, requests, concurrency, timeout_s):
        state["requests"].append((list(requests), concurrency))
        state["events"].append(("load", None))
        return state["level"]

    monkeypatch.setattr(va, "run_load", run_load)
    hf = tmp_path / "hf-draft"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    state["draft"] = hf
    return state


def test_the_command_measures_each_method_in_its_own_server(fake, tmp_path):
    out = tmp_path / "acc.json"
    rc = main(["accept", "--engine", "vllm", "--method", "ngram,draft_model", "--draft-model", str(fake["draft"]),
               "--max-depth", "4", "--num-prompts", "3", "--concurrency", "2", "--temperature", "0.7", "--top-k", "20",
               "--no-progress", "-o", str(out)])
    assert rc == 0
    assert fake["configs"] == [va.speculative_config("ngram", 4), va.speculative_config("draft_model", 4, fake["draft"])]
    (sent, conc), _ = fake["requests"]
    assert conc == 2 and len(sent) == 3 and all(r.max_tokens == 64 for r in sent)
    assert [r.extras for r in sent] == [{"temperature": 0.7, "seed": i, "top_k": 20} for i in range(3)]
    assert [m["role"] for m in sent[1].messages] == ["user", "assistant", "user"]  # a held-out follow-up
    doc = json.loads(out.read_text())
    assert sorted(doc) == ["draft_model", "ngram"]
    acc = load_acceptance(f"{out}:draft_model")
    assert acc.accuracy[:, 0] == pytest.approx([0.5, 13 / 30, 5 / 13, 0.4])
    assert acc.source["sampling"] == {"temperature": 0.7, "top_k": 20, "top_p": 1.0}
    assert doc["draft_model"]["guesser"]["draft_passes"] == "depth" and "held-out" in doc["ngram"]["source"]
    # the drafter's server starts while ngram's requests run (counts only); its own load, which is timed, alone
    assert fake["events"] == [("up", "ngram"), ("launch", "draft_model"), ("load", None), ("stop", "ngram"),
                              ("up", "draft_model"), ("load", None), ("stop", "draft_model")]


def test_a_drafters_timed_load_runs_at_its_own_concurrency_and_a_bad_one_is_refused(fake):
    from workflows.cli.engines import open_from_args

    engine = open_from_args(None, None)
    reqs = [Request([{"role": "user", "content": f"q{i}"}], 16, {}) for i in range(3)]
    va.measure_methods(engine, ["ngram", "draft_model"], reqs, GREEDY, draft_length=4, concurrency=4,
                       draft_model=fake["draft"], drafter_concurrency=1)
    # the serving main job prices a draft pass from the drafter's load (draft_costs), at the level it drafts at
    assert [conc for _, conc in fake["requests"]] == [4, 1]
    va.measure_methods(engine, ["draft_model"], reqs, GREEDY, draft_length=4, concurrency=2, draft_model=fake["draft"])
    assert fake["requests"][-1][1] == 2  # without drafter_concurrency every load runs at `concurrency`
    for bad in (0, 2000, True):
        with pytest.raises(UserError, match="--concurrency: expected an integer in 1..1024"):
            va.measure_methods(engine, ["draft_model"], reqs, GREEDY, draft_model=fake["draft"],
                               drafter_concurrency=bad)
    assert len(fake["requests"]) == 3  # refused before any server


def test_sampled_passes_count_every_draw_and_keep_the_first_ones_time(fake, monkeypatch):
    from workflows.cli.engines import open_from_args

    # cumulative counters: nothing, after the timed pass (the level of BEFORE/AFTER), after both passes
    pages = itertools.cycle([page(0, 0, 0, [0, 0, 0, 0]), page(40.0, 160.0, 50.0, [30.0, 13.0, 5.0, 2.0]),
                             page(70.0, 280.0, 80.0, [50.0, 20.0, 8.0, 2.0])])
    monkeypatch.setattr(va, "fetch_spec_decode", lambda url: spec_decode_counters(next(pages)))
    engine = open_from_args(None, None)
    reqs = [Request([{"role": "user", "content": f"q{i}"}], 64, {}) for i in range(2)]
    sampled = Sampling(0.7, 0, 0.9)
    out = va.measure_methods(engine, ["ngram", "suffix"], reqs, sampled, seed=3, draft_length=4, concurrency=4,
                             plugin=True, passes=2)
    # pass p sends other draws: seeds seed + p n + i, at the acceptance concurrency
    assert [[r.extras["seed"] for r in sent] for sent, _ in fake["requests"]] == [[3, 4], [5, 6]] * 2
    # each later pass from an empty prefix cache; suffix also forgets the answers it drafts from
    assert [e for e in fake["events"] if e[0] == "reset"] == [("reset", "ngram", False), ("reset", "suffix", True)]
    v = out["suffix"]["vllm"]
    assert v["passes"] == 2 and v["counted_requests"] == 4 and out["suffix"]["prompts"] == 4
    # counts: both passes (224 tokens - 4 requests - 80 accepted = 140 steps); time and steps: the first pass's
    assert (v["steps"], v["accepted_tokens"], v["drafts"]) == (140, 80.0, 70.0)
    assert v["tokens_per_step"] == pytest.approx(1 + 80 / 140)
    assert (v["requests"], v["output_tokens"], v["load_wall_s"], v["timed_steps"]) == (2, 112, 10.0, 60)
    # without the plugin a reset leaves suffix's cached answers: one pass for it, ngram still two
    fake["requests"].clear()
    out = va.measure_methods(engine, ["ngram", "suffix"], reqs, sampled, draft_length=4, passes=2)
    assert [len(sent) for sent, _ in fake["requests"]] == [2, 2, 2]
    assert out["ngram"]["vllm"]["passes"] == 2 and out["suffix"]["vllm"]["passes"] == 1
    for bad, match in ((0, "1..16"), (17, "1..16"), (True, "1..16")):
        with pytest.raises(UserError, match=f"--passes: expected an integer in {match}"):
            va.measure_methods(engine, ["ngram"], reqs, sampled, passes=bad)
    with pytest.raises(UserError, match="--passes 2: greedy answers repeat"):
        va.measure_methods(engine, ["ngram"], reqs, GREEDY, passes=2)
    assert len(fake["requests"]) == 3  # refused before any server


def test_the_command_sends_sampled_passes_and_says_so(fake, monkeypatch, tmp_path, capsys):
    pages = itertools.cycle([BEFORE, AFTER, page(85.0, 340.0, 107.0, [64.0, 28.0, 11.0, 4.0])])
    monkeypatch.setattr(va, "fetch_spec_decode", lambda url: spec_decode_counters(next(pages)))
    out = tmp_path / "acc.json"
    args = ["accept", "--engine", "vllm", "--method", "ngram", "--num-prompts", "2", "--passes", "2", "--no-progress",
            "-o", str(out)]
    assert main(args) == 2 and not out.exists()  # greedy: one pass measures it
    assert "--passes 2: greedy answers repeat" in capsys.readouterr().err
    assert main(args + ["--temperature", "0.7"]) == 0
    assert [[r.extras["seed"] for r in sent] for sent, _ in fake["requests"]] == [[0, 1], [2, 3]]
    doc = json.loads(out.read_text())
    assert doc["vllm"]["passes"] == 2 and "(2 passes)" in doc["source"] and doc["prompts"] == 4


def test_a_failure_stops_the_server_started_ahead(fake, tmp_path):
    fake["level"] = level(record(0, 60, 30), record(1, 3, 3, error="HTTP 400: too long"))
    assert main(["accept", "--engine", "vllm", "--method", "ngram,draft_model", "--draft-model", str(fake["draft"]),
                 "--no-progress", "-o", str(tmp_path / "a.json")]) == 2
    assert fake["events"] == [("up", "ngram"), ("launch", "draft_model"), ("load", None), ("stop", "ngram"),
                              ("stop", "draft_model")]


def test_one_method_writes_its_entry_and_a_workload_keeps_its_requests(fake, tmp_path):
    work = tmp_path / "w.jsonl"
    work.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}], "max_tokens": 9, "temperature": 1}) + "\n")
    out = tmp_path / "one.json"
    assert main(["accept", "--engine", "vllm", "--method", "ngram", "--workload", str(work), "--no-progress",
                 "-o", str(out)]) == 0
    (sent, conc), = fake["requests"]
    assert conc == 4 and [(r.max_tokens, r.extras) for r in sent] == [(9, {"temperature": 0.0})]
    assert fake["configs"] == [va.speculative_config("ngram", va.DEFAULT_DRAFT_LENGTH)]
    assert load_acceptance(str(out)).max_depth == va.DEFAULT_DRAFT_LENGTH


def test_a_failed_request_writes_nothing(fake, tmp_path, capsys):
    fake["level"] = level(record(0, 60, 30), record(1, 3, 3, error="HTTP 400: too long"))
    out = tmp_path / "acc.json"
    assert main(["accept", "--engine", "vllm", "--method", "ngram", "--no-progress", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 of 2 requests failed" in err[0] and "HTTP 400" in err[0]
    assert not out.exists()


@pytest.mark.parametrize("argv, match", [
    (["--engine", "hf", "--method", "ngram"], "--method: only with a serving engine"),
    (["--engine", "vllm", "--method", "ngram,mtp"], "--method mtp: expected one of"),
    (["--engine", "vllm", "--method", "eagle3"], "--method eagle3 needs its drafter's folder (--drafter DIR"),
    (["--engine", "vllm", "--method", "ngram,ngram"], "expected distinct names"),
    (["--engine", "vllm", "--max-depth", "99"], "--max-depth: expected an integer in 1..24"),
    (["--engine", "vllm", "--plan", "x.json"], "--plan: not with --engine vllm"),
    (["--engine", "vllm", "--workload", "w.jsonl", "--prompts", "p.jsonl"], "give one"),
    (["--engine", "vllm", "--method", "suffix"], "arctic-inference"),  # the fake's python has none
])
def test_bad_input_is_one_line(fake, tmp_path, capsys, argv, match):
    out = tmp_path / "acc.json"
    assert main(["accept", *argv, "--no-progress", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err
    assert not out.exists() and fake["configs"] == []


# ---------------------------------------------------------------------------------------------- the draft folder

def _toy(tmp_path: Path, layers: int = 3, draft_layers: int = 2, target: str = "toy") -> tuple[Path, Path]:
    """A target folder of `layers` layers and a project draft LM of `draft_layers` on it (numpy only)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    t, d = tmp_path / "target", tmp_path / "draft_lm"
    t.mkdir()
    d.mkdir()
    (t / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers, "dtype": "float32",
                                              "tie_word_embeddings": True, "layer_types": ["full"] * layers}))
    (t / "tokenizer.json").write_text("{}")
    layer = {f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal((8, 4), dtype=np.float32) for i in range(layers)}
    save_file({"model.embed_tokens.weight": rng.standard_normal((10, 4), dtype=np.float32),
               "model.norm.weight": np.ones(4, np.float32), **layer}, str(t / "model.safetensors"))
    own = {k: v.astype(np.float16) + 1 for k, v in layer.items() if int(k.split(".")[2]) < draft_layers}
    save_file({**own, "model.norm.weight": np.full(4, 2, np.float16)}, str(d / "draft_lm.safetensors"))
    (d / "draft_lm.json").write_text(json.dumps({"format": "tree-planner/draft-lm", "num_layers": draft_layers,
                                                "target": target}))
    return d, t


def test_the_draft_folder_carries_the_targets_embedding_and_the_drafts_layers(tmp_path):
    from safetensors.numpy import load_file

    d, t = _toy(tmp_path)
    out = write_draft_folder(d, t, tmp_path / "out", target_name="toy")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["layer_types"] == ["full"] * 2 and cfg["model_type"] == "llama"
    got, target, own = (load_file(str(p)) for p in (out / "model.safetensors", t / "model.safetensors",
                                                     d / "draft_lm.safetensors"))
    assert sorted(got) == sorted([*own, "model.embed_tokens.weight"])
    assert np.array_equal(got["model.embed_tokens.weight"], target["model.embed_tokens.weight"])
    assert all(got[k].dtype == np.float32 and np.array_equal(got[k], own[k].astype(np.float32)) for k in own)
    assert (out / "tokenizer.json").is_file() and (out / MARKER).is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind
    # the cache converts once and then reuses
    cached = served_draft(d, t, cache=tmp_path / "cache")
    stamp = (cached / "model.safetensors").stat().st_mtime_ns
    assert served_draft(d, t, cache=tmp_path / "cache") == cached
    assert (cached / "model.safetensors").stat().st_mtime_ns == stamp
    assert served_draft(out, t) == out  # a Hugging Face folder is used as it is


@pytest.mark.parametrize("case, match", [
    ("layers", "not a 4-layer draft"), ("target", "field 'target' is 'other'"), ("config", "draft_lm.json: file not found"),
    ("deep", "does not fit the target's 3 layers"),
])
def test_a_draft_that_does_not_fit_is_refused_and_nothing_is_written(tmp_path, case, match):
    d, t = _toy(tmp_path, target="other" if case == "target" else "toy")
    meta = json.loads((d / "draft_lm.json").read_text())
    if case == "layers":
        (t / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 6}))
        meta["num_layers"] = 4
    if case == "deep":
        meta["num_layers"] = 5
    (d / "draft_lm.json").write_text(json.dumps(meta))
    if case == "config":
        (d / "draft_lm.json").unlink()
    with pytest.raises(UserError, match=match):
        write_draft_folder(d, t, tmp_path / "out", target_name="toy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft_lm", "target"]


def test_the_folder_computes_the_draft_lms_logits(tmp_path):
    """On the project's toy model: transformers loads the written folder as a plain Llama, and its
    logits are the draft LM's (decoder/guessers/draft.py) on the target's embedding and head."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from decoder.torch_ops.draft_lm import build_draft_lm, load_draft_model, save_draft_lm

    builtin = ROOT / "models" / "builtin"
    target = AutoModelForCausalLM.from_pretrained(builtin, dtype=torch.float32)
    draft = build_draft_lm(target, 2)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in draft.model.layers.parameters():
            p.add_(0.02 * torch.randn_like(p))  # its own layers, not the target's first two
    save_draft_lm(draft, tmp_path / "draft_lm", {"target": "builtin"})
    out = write_draft_folder(tmp_path / "draft_lm", builtin, tmp_path / "hf", target_name="builtin")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = load_draft_model(tmp_path / "draft_lm", target)
    ids = torch.tensor([[5, 17, 300, 42, 7, 99]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ref(ids).logits)


# ---------------------------------------------------------------------------------------------- in vLLM

def _vllm_skip() -> str | None:
    if vllm_env.venv_python() is None:
        return f"the vLLM environment {vllm_env.venv_dir()} is not set up (bash {vllm_env.SETUP})"
    return None


def test_vllm_loads_the_draft_folder_and_drafts_with_it(tmp_path):
    reason = _vllm_skip()
    if reason:
        if REQUIRED:
            pytest.fail(f"TREE_PLANNER_REQUIRE_VLLM=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    from decoder.engines.shipped import model_dir

    from smollm2_drafts import smollm2_draft_lm

    smollm2 = model_dir("smollm2-135m", progress=False)
    layers = json.loads((smollm2 / "config.json").read_text())["num_hidden_layers"]  # the target itself: drafts accepted
    draft = smollm2_draft_lm(tmp_path / "draft_lm", layers=layers)
    folder = write_draft_folder(draft, smollm2, tmp_path / "draft", target_name="smollm2-135m")
    work = tmp_path / "w.jsonl"
    asks = ["Write the days of the week, one per line.",
            "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog."]
    work.write_text("".join(json.dumps({"messages": [{"role": "user", "content": a}], "max_tokens": 24}) + "\n"
                            for a in asks))
    out = tmp_path / "acc.json"
    assert main(["accept", "--engine", "vllm", "--method", "draft_model", "--draft-model", str(folder), "--max-depth",
                 "3", "--concurrency", "2", "--workload", str(work), "--no-progress", "-o", str(out)]) == 0
    rec = json.loads(out.read_text())
    v = rec["vllm"]
    assert v["speculative_config"]["model"] == str(folder) and v["requests"] == 2
    assert v["drafts"] > 0 and v["draft_tokens"] > 0 and v["accepted_tokens"] > 0
    assert sum(v["accepted_per_position"]) == v["accepted_tokens"] and len(rec["accuracy"]) == 3
    assert rec["accuracy"][0][0] > 0 and load_acceptance(str(out)).max_depth == 3
