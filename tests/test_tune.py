"""planner tune: search space, the `planner plan` guarantee, storage (resume, several workers), CLI."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

optuna = pytest.importorskip("optuna")

from planner.cost import Guessing, default_guessing, input_lengths, predict, predicted_speedup  # noqa: E402
from planner.errors import UserError  # noqa: E402
from planner.plan import plan  # noqa: E402
from planner.profile import load_profile  # noqa: E402
from planner.tree import load_tree  # noqa: E402
from workflows.cli.main import main  # noqa: E402
from workflows.tune.search import (  # noqa: E402
    Config,
    SearchSpace,
    build_tree,
    kv_bytes_per_token,
    open_storage,
    parse_accept_spec,
    predict_config,
    tune,
)

REPO = Path(__file__).resolve().parents[1]
PPD_ROWS = [[0.55, 0.12, 0.05, 0.03], [0.30, 0.10, 0.05, 0.03], [0.15, 0.07, 0.04, 0.02]]
MEDUSA_ROWS = [[0.50, 0.10, 0.05], [0.30, 0.08, 0.04], [0.18, 0.06, 0.03]]


def _write(path: Path, obj) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


@pytest.fixture
def inputs(tmp_path):
    """A small acceptance collection and a profile whose latency bends upward after 16 tokens."""
    acc = _write(tmp_path / "acc.json", {"ppd-x": {"accuracy": PPD_ROWS}, "medusa-x": {"accuracy": MEDUSA_ROWS},
                                          "draft": {"positional": [0.6, 0.15, 0.05]}})
    n = [1, 2, 4, 8, 16, 24, 32, 48]
    lat = [0.010, 0.0101, 0.0102, 0.0105, 0.011, 0.0135, 0.016, 0.022]
    prof = _write(tmp_path / "prof.json", {"device": "fake", "input_lengths": n, "latency_s": lat})
    return tmp_path, acc, prof


def _space(acc, methods=("ppd", "medusa", "sequoia"), **kw):
    sources = [parse_accept_spec(f"{acc}:ppd-x"), parse_accept_spec(f"{acc}:medusa-x"), parse_accept_spec(f"{acc}:draft")]
    return SearchSpace(sources, methods=methods, max_size=24, **kw)


def test_accept_spec_prefixes(inputs):
    _, acc, _ = inputs
    assert parse_accept_spec(f"{acc}:ppd-x").methods == ("ppd",)
    assert parse_accept_spec(f"{acc}:medusa-x").methods == ("medusa",)
    assert parse_accept_spec(f"{acc}:draft").methods == ("sequoia",)  # positional: a draft model
    s = parse_accept_spec(f"ppd/e4={acc}:medusa-x")
    assert (s.methods, s.ept) == (("ppd",), 4)
    assert parse_accept_spec(f"all={acc}:draft").methods == ("medusa", "sequoia", "ppd")
    with pytest.raises(UserError, match="no entry named"):
        parse_accept_spec(f"ppd={acc}:nope")


def test_predict_matches_planner_and_counts_ensemble(inputs):
    _, acc, prof = inputs
    profile = load_profile(prof)
    space = _space(acc)
    for cfg in (Config("ppd", f"{acc}:ppd-x", input_length=14, prompt_tokens=3),
                Config("medusa", f"{acc}:medusa-x", size=9),
                Config("sequoia", f"{acc}:draft", size=7, max_depth=4)):
        tree = build_tree(cfg, space, profile)
        src = space.source(cfg.source)
        p1 = predict_config(tree, profile, src, replace(space, draft_latency_s=0.002))
        draft = 0.002 if cfg.method == "sequoia" else None  # only sequoia's drafts come from a draft model
        g = default_guessing(cfg.method, src.accept, draft_s=draft)
        assert p1.speedup == pytest.approx(predicted_speedup(tree, profile, g))
        assert p1.max_input_length == max(input_lengths(tree, g))
        if cfg.method == "ppd":
            # E copies per prompt token: longer forward passes, same tokens per step, lower speedup
            p3 = predict(tree, profile, Guessing(prompt_tokens=True, ensemble=3))
            lengths = input_lengths(tree, Guessing(prompt_tokens=True, ensemble=3))
            assert lengths == [1 + len(s.nodes) + 3 * sum(s.prompt_tokens) for s in tree.states]
            assert p3.tokens_per_step == pytest.approx(p1.tokens_per_step)
            assert p3.max_input_length > p1.max_input_length and p3.speedup < p1.speedup


def test_best_is_at_least_planner_plan(inputs):
    """The guarantee: the study contains `planner plan`'s automatic point of every method."""
    tmp, acc, prof = inputs
    profile = load_profile(prof)
    space = _space(acc)
    res = tune(space, profile, trials=9, storage=str(tmp / "s.db"), study_name="g", out=tmp / "best.json",
               seed=1, progress=False)
    # independent: the planner's own automatic choice per method, with its defaults
    auto = {m: plan(m, src.accept, profile=profile, max_size=24).predicted_speedup
            for m in space.methods for src in space.sources_for(m)}
    assert res.best["values"][0] >= max(auto.values()) - 1e-12
    assert sorted(r["params"]["method"] for r in res.reference) == sorted(auto)
    for r in res.reference:  # each enqueued point reproduced plan's value exactly
        assert r["values"][0] == pytest.approx(auto[r["params"]["method"]], rel=1e-12)
    tree = load_tree(tmp / "best.json")
    assert tree.predicted_speedup == pytest.approx(res.best["values"][0])
    assert tree.settings["tune"]["trial"] == res.best["trial"]
    assert Config(**tree.settings["tune"]["config"]).method == tree.method
    assert res.trials_total <= 9 and res.trials_run == 9


def test_resume_adds_trials_and_refuses_other_inputs(inputs):
    tmp, acc, prof = inputs
    profile = load_profile(prof)
    space = _space(acc, methods=("medusa",))
    url = f"sqlite:///{tmp / 'r.db'}"
    tune(space, profile, trials=3, storage=url, study_name="r", progress=False, seed=0)
    tune(space, profile, trials=4, storage=url, study_name="r", progress=False, seed=0)
    study = optuna.load_study(study_name="r", storage=open_storage(url))
    assert len(study.trials) == 7
    assert sum(bool(t.user_attrs.get("reference")) for t in study.trials) == 1  # enqueued once only
    other = _space(acc, methods=("medusa",), max_prompt_tokens=2)
    other.max_size = 10
    with pytest.raises(UserError, match="other inputs"):
        tune(other, profile, trials=1, storage=url, study_name="r", progress=False)
    with pytest.raises(UserError, match="optimises"):
        tune(space, profile, trials=1, storage=url, study_name="r", memory="input_length", progress=False)


def test_pareto_front_is_non_dominated(inputs):
    tmp, acc, prof = inputs
    profile = load_profile(prof)
    space = _space(acc, methods=("ppd", "medusa"))
    res = tune(space, profile, trials=14, storage=str(tmp / "p.log"), study_name="p", memory="input_length",
               out=tmp / "best.json", seed=3, progress=False)
    study = optuna.load_study(study_name="p", storage=open_storage(str(tmp / "p.log")))
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    front = {p["trial"] for p in res.pareto}

    def dominates(a, b):
        return a[0] >= b[0] and a[1] <= b[1] and (a[0] > b[0] or a[1] < b[1])

    for t in done:  # brute force: front = exactly the non-dominated trials
        dominated = any(dominates(u.values, t.values) for u in done)
        assert (t.number in front) == (not dominated)
    speeds = [p["values"][0] for p in res.pareto]
    assert speeds == sorted(speeds, reverse=True)
    for t in done:  # the memory objective is the largest forward pass of the trial's tree
        assert t.values[1] == t.user_attrs["max_input_length"]
    tree = load_tree(tmp / "best.json")
    assert tree.settings["tune"]["values"][0] == max(speeds)
    assert len(tree.settings["tune"]["pareto"]) == len(res.pareto)


def test_kv_bytes_objective(inputs, tmp_path):
    tmp, acc, prof = inputs
    cfg = _write(tmp_path / "config.json", {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                                             "hidden_size": 512})
    assert kv_bytes_per_token(cfg) == 2 * 4 * 2 * 64 * 2
    profile = load_profile(prof)
    res = tune(_space(acc, methods=("medusa",)), profile, trials=3, storage=str(tmp / "k.db"), study_name="k",
               memory="kv_bytes", kv_per_token=kv_bytes_per_token(cfg), progress=False, seed=0)
    for p in res.pareto:
        assert p["values"][1] == p["max_input_length"] * 2048
    with pytest.raises(UserError, match="KV size"):
        tune(_space(acc, methods=("medusa",)), profile, trials=1, storage=str(tmp / "k2.db"), study_name="k",
             memory="kv_bytes", progress=False)


def test_measured_objective_uses_evaluator_and_searches_verification(inputs):
    """Decoding itself is tested by the decoder; here a stand-in evaluator checks the wiring."""
    tmp, acc, prof = inputs
    seen = []

    def evaluator(tree, cfg, src):
        seen.append(cfg)
        return {"tokens_per_s": 100.0 * tree.expected_tokens_per_step / tree.max_input_length ** 0.1,
                "tokens_per_step": tree.expected_tokens_per_step}

    space = _space(acc, methods=("medusa", "ppd"), temperature=0.7)
    res = tune(space, None, trials=6, storage=str(tmp / "m.db"), study_name="m", objective="measured",
               evaluator=evaluator, out=tmp / "best.json", seed=0, progress=False, allow_typical=True)
    assert len(seen) >= 1 and all(c.verify in ("typical", "lossless") for c in seen)
    assert all(c.size is not None or c.input_length is not None for c in seen)  # no profile: no automatic size
    assert res.best["values"][0] == max(100.0 * build_tree(c, space, None).expected_tokens_per_step
                                        / build_tree(c, space, None).max_input_length ** 0.1 for c in seen)
    tree = load_tree(tmp / "best.json")
    assert tree.settings["tune"]["decode"]["verify_rule"] in ("typical", "lossless")
    assert tree.settings["tune"]["decode"]["temperature"] == 0.7
    assert tree.settings["distribution_exact"] == (tree.settings["tune"]["decode"]["verify_rule"] != "typical")
    assert tree.settings["sampling"] == {"temperature": 0.7, "top_k": 0, "top_p": 1.0}
    seen.clear()  # without allow_typical only the lossless rule decodes: typical stays off by default
    tune(space, None, trials=3, storage=str(tmp / "n.db"), study_name="n", objective="measured", evaluator=evaluator,
         seed=0, progress=False)
    assert seen and all(c.verify == "auto" for c in seen)


def test_interrupt_keeps_best_so_far(inputs):
    tmp, acc, prof = inputs
    calls = []

    def evaluator(tree, cfg, src):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return {"tokens_per_s": float(len(calls))}

    with pytest.raises(KeyboardInterrupt):
        tune(_space(acc, methods=("medusa",)), None, trials=10, storage=str(tmp / "i.db"), study_name="i",
             objective="measured", evaluator=evaluator, out=tmp / "best.json", progress=False, seed=0)
    tree = load_tree(tmp / "best.json")
    assert tree.settings["tune"]["values"] == [2.0] and tree.settings["tune"]["completed_trials"] == 2


@pytest.mark.parametrize("storage", ["w.log", "w.db"])
def test_two_worker_processes_share_one_study(inputs, storage):
    tmp, acc, prof = inputs
    cmd = [sys.executable, "-m", "planner", "tune", "--accept", f"{acc}:medusa-x", "--profile", prof,
           "--methods", "medusa", "--max-size", "16", "--trials", "5", "--storage", str(tmp / storage),
           "--study-name", "shared", "-o", str(tmp / "best.json"), "--no-progress"]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    study = optuna.load_study(study_name="shared", storage=open_storage(str(tmp / storage)))
    assert len(study.trials) == 10  # the two workers' trials add up
    assert len({t.number for t in study.trials}) == 10


_POP = """
import sys
import optuna
from workflows.tune.search import open_storage
optuna.logging.set_verbosity(optuna.logging.ERROR)
study = optuna.load_study(study_name="q", storage=open_storage(sys.argv[1]))
while True:
    t = study.ask()
    if t.number >= int(sys.argv[2]):  # nothing waiting: ask made a fresh trial
        study.tell(t, state=optuna.trial.TrialState.FAIL)
        break
    study.tell(t, 0.0)  # a trial another worker popped too fails here: "Cannot tell a COMPLETE trial"
    print(t.number, flush=True)
"""


def test_sqlite_workers_never_pop_one_enqueued_trial_twice(tmp_path):
    """SQLite ignores SELECT ... FOR UPDATE, on which Optuna hands each waiting trial to one worker;
    open_storage makes every SQLite transaction take the write lock first (the flaky two-worker failure)."""
    url, n = str(tmp_path / "q.db"), 60
    study = optuna.create_study(study_name="q", storage=open_storage(url))
    for i in range(n):
        study.enqueue_trial({"i": i})
    procs = [subprocess.Popen([sys.executable, "-c", _POP, url, str(n)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    popped = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        popped += [int(x) for x in out.split()]
    assert sorted(popped) == list(range(n))


def test_cli_errors_are_one_line(inputs, capsys):
    tmp, acc, prof = inputs
    base = ["tune", "--accept", f"{acc}:medusa-x", "-o", str(tmp / "b.json"), "--storage", str(tmp / "c.db")]
    cases = [
        (base + ["--methods", "foo"], "--methods foo"),
        (base, "needs a latency profile"),
        (base + ["--profile", prof, "--trials", "-1"], "--trials must be at least 0"),
        (base + ["--profile", prof, "--storage", str(tmp / "x.txt")], "expected a URL"),
        (base + ["--objective", "measured"], "needs --model"),
        (["tune", "--accept", str(tmp / "missing.json"), "-o", "b.json"], "file not found"),
    ]
    for argv, msg in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert msg in err and err.startswith("planner tune: error:") and err.count("\n") == 1, err
    assert not (tmp / "b.json").exists()


def test_cli_writes_best_tree(inputs, capsys):
    tmp, acc, prof = inputs
    argv = ["tune", "--accept", f"{acc}:ppd-x", "--accept", f"{acc}:medusa-x", "--profile", prof, "--methods",
            "ppd,medusa", "--max-size", "16", "--trials", "6", "-o", str(tmp / "best.json"), "--seed", "0", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "planner plan (ppd)" in out and "planner plan (medusa)" in out
    tree = load_tree(tmp / "best.json")
    for m in ("ppd", "medusa"):  # the guarantee against the `planner plan` command itself
        assert main(["plan", m, "--accept", f"{acc}:{m}-x", "--profile", prof, "--max-size", "16", "-q",
                     "-o", str(tmp / f"plan-{m}.json")]) == 0
        assert tree.predicted_speedup >= load_tree(tmp / f"plan-{m}.json").predicted_speedup - 1e-12
    assert (tmp / "best.optuna.db").exists()  # default storage next to the output
    assert tree.settings["tune"]["completed_trials"] >= 2
    assert np.isfinite(tree.predicted_speedup)


def test_measured_objective_decodes_with_a_tiny_model(inputs):
    """End to end through the decoder: a random-weight tiny model, one short prompt, oracle guessers."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from workflows.tune.measured import MeasuredEvaluator

    torch.set_num_threads(2)
    tmp, acc, prof = inputs
    ev = MeasuredEvaluator("tiny", ["Tell me about trees."], max_new_tokens=8, device="cpu", dtype="fp32")
    assert ev.plain_tokens_per_s > 0
    space = _space(acc, methods=("medusa", "ppd"))
    res = tune(space, None, trials=3, storage=str(tmp / "t.db"), study_name="t", objective="measured",
               evaluator=ev, seed=0, progress=False)
    study = optuna.load_study(study_name="t", storage=open_storage(str(tmp / "t.db")))
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert done and res.best["values"][0] == max(t.values[0] for t in done)
    for t in done:
        assert t.values[0] == t.user_attrs["measured_tokens_per_s"] > 0
        assert 1.0 <= t.user_attrs["measured_tokens_per_step"] <= 1 + t.user_attrs["max_input_length"]


def test_oracle_uses_one_row_per_distance():
    torch = pytest.importorskip("torch")
    from decoder import OracleGuesser

    seq = torch.arange(100)
    rows = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    g = OracleGuesser(seq, 1000, 3, top_k=3, accuracy=rows)
    out = g.guess(None, 10, 3)  # distances 1..3 beyond position 10: true tokens 11, 12, 13
    assert out.shape == (3, 3) and g.top_k == 3 and g.num_distances == 3
    assert out[0, 0] == 11 and 11 not in out[0, 1:].tolist()  # distance 1: always rank 0
    assert out[1, 1] == 12 and 12 not in out[1, [0, 2]].tolist()  # distance 2: always rank 1
    assert 13 not in out[2].tolist()  # distance 3: never guessed
    half = OracleGuesser(seq, 1000, 1, top_k=2, seed=1, accuracy=[[0.5, 0.0]])
    hits = sum(int(half.guess(None, 10, 1)[0, 0] == 11) for _ in range(2000))
    assert 900 < hits < 1100  # rank 0 with probability 0.5
