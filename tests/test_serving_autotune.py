"""The serving main job's planning and deciding (workflows/mainjob/serving.py), without vLLM: the chain
model against brute force, the planned draft length per level against an exhaustive search, the
schedule's ranges, the paired rule per level (a real gain wins, noise does not, a changed token
disqualifies) and the one-config decision; and the command's refusals before anything starts."""
from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from planner import serving as planning
from planner.errors import UserError
from planner.profile import LatencyProfile
from profiler.load_generator import LoadResult, RequestRecord
from profiler.serving_metrics import SpecDecodeCounters
from workflows.mainjob import serving as sv
from workflows.mainjob.pipeline import autotune
from workflows.mainjob import serving_decision as sd
from workflows.mainjob import serving_plan as sp
from workflows.mainjob import serving_race as sr

ROOT = Path(__file__).resolve().parents[1]


def test_chain_rate_is_the_expected_tokens_by_enumeration():
    """E[tokens per step] of a chain: enumerate every accept/reject pattern of k drafts, the step keeps
    the accepted prefix plus the target's own token."""
    a = [0.9, 0.7, 0.5, 0.3]
    for k in range(5):
        expect = 0.0
        for bits in itertools.product([0, 1], repeat=k):
            p = math.prod(a[i] if b else 1 - a[i] for i, b in enumerate(bits))
            prefix = next((i for i, b in enumerate(bits) if not b), k)
            expect += p * (1 + prefix)
        assert planning.chain_rate(a, k) == pytest.approx(expect)


def _profiles(levels, fixed_s=0.1, per_token_s=0.004):
    """Step time fixed + per_token * b * (1 + K): a CPU's serving step (mostly fixed cost at small b)."""
    ns = np.arange(1, 10)
    return {b: LatencyProfile(ns, fixed_s + per_token_s * b * ns, {"file": "fake"}) for b in levels}


def _faked_inputs(monkeypatch, tmp_path, levels, methods, exported: list | None = None):
    """The serving autotune's engine, profile, acceptance and exports faked (the race is each test's own):
    (profiles by level, the acceptance record every method gets); `exported` collects what is exported."""
    from decoder.engines import registry
    import planner.profile as pp

    profiles = _profiles(levels, per_token_s=0.004)
    rec = {"accuracy": [[x] for x in [0.7, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1]], "guesser": {"draft_passes": "one"}}
    engine = type("E", (), {"caps": type("C", (), {"name": "vllm"})(), "model_name": "m"})()
    monkeypatch.setattr(registry, "open_engine", lambda name, req: engine)
    monkeypatch.setattr(pp, "load_batch_profiles", lambda path: profiles)
    monkeypatch.setattr(sv, "_profile", lambda *a: tmp_path / "profile.json")
    monkeypatch.setattr(sv, "_acceptance", lambda *a: {m: rec for m in methods})
    sink = [] if exported is None else exported
    monkeypatch.setattr(sv, "_exports", lambda chosen, out, models: sink.append(chosen))
    return profiles, rec


@pytest.mark.parametrize("acc", [[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2], [0.3, 0.1, 0.05, 0.01, 0, 0, 0, 0],
                                 [0.99] * 8])
def test_planned_draft_length_is_the_best_of_every_length_and_the_chain_planners(acc):
    from planner.accept import from_entry
    from planner.batch import plan_chain_schedule
    from planner.cost import Guessing

    levels = [1, 2, 4, 8, 16]
    profiles = _profiles(levels)
    rec = {"accuracy": [[x] for x in acc], "guesser": {"draft_passes": "one"}}
    plan = planning.plan_method("ngram", rec, profiles, levels, 8, {})
    prefix = np.cumprod(acc)
    for b in levels:
        rates = [planning.predicted_tokens_per_s(prefix, profiles[b], b, k) for k in range(9)]
        assert rates[plan["per_level"][b]] == pytest.approx(max(rates), rel=1e-9)
        assert plan["predicted"][b] == pytest.approx(max(rates), rel=1e-9)
        assert rates[1] == pytest.approx(b * planning.chain_rate(acc, 1) / profiles[b].latency(2))
        entry = plan_chain_schedule(from_entry(rec), {b: profiles[b]}, [b], Guessing(), max_depth=8)[0]
        assert (0 if entry.tree is None else entry.tree.depth) == plan["per_level"][b]
    fixed = {k: np.mean(np.log([planning.predicted_tokens_per_s(prefix, profiles[b], b, k) for b in levels]))
             for k in range(1, 9)}
    assert plan["best_fixed"] == max(fixed, key=fixed.get)


def test_a_proposer_that_drafts_on_few_steps_is_priced_by_the_mixture():
    """Steps without a match cost a plain step: by enumeration over (drafted or not) x accepted prefix,
    tokens/s is b E[tau] / E[step]; pricing every step as a drafting one would choose shorter drafts."""
    profiles = _profiles([1])
    per_draft, rate = [0.8, 0.7, 0.6, 0.5], 0.25
    rec = {"accuracy": [[x] for x in np.array(per_draft) * rate], "guesser": {"draft_passes": "one"},
           "vllm": {"per_draft": per_draft, "draft_rate": rate}}
    prefix, r = planning.drafting(rec)
    assert r == rate and list(prefix) == per_draft
    for k in range(1, 5):
        tokens = (1 - rate) * 1 + rate * (1 + sum(per_draft[:k]))
        seconds = (1 - rate) * profiles[1].latency(1) + rate * profiles[1].latency(1 + k)
        assert planning.predicted_tokens_per_s(prefix, profiles[1], 1, k, rate=rate) == pytest.approx(tokens / seconds)
    mixture = planning.plan_method("suffix", rec, profiles, [1], 4, {})["per_level"][1]
    every_step = planning.plan_method("suffix", {k: v for k, v in rec.items() if k != "vllm"}, profiles, [1], 4,
                                      {})["per_level"][1]
    assert mixture >= every_step


def test_a_proposer_that_stops_where_it_is_unsure_is_scored_on_what_it_sent():
    """suffix decoding drafts up to k tokens by its confidence (measured here: 1.96 tokens a drafting step at
    k = 8): a step scores what was sent, so its price is the profile at 1 + min(k, sent), by hand; a
    proposer that sends k every time (ngram) keeps k, and a record without counters is priced as before."""
    profiles = _profiles([1, 16])
    per_draft, rate = [0.6, 0.4, 0.2, 0.1, 0.05, 0.02, 0.01, 0.01], 0.5
    vllm = {"per_draft": per_draft, "draft_rate": rate, "draft_length": 8, "drafts": 100, "draft_tokens": 196}
    rec = {"accuracy": [[x] for x in np.array(per_draft) * rate], "guesser": {"draft_passes": "one"}, "vllm": vllm}
    assert planning.drafted_per_step(rec) == pytest.approx(1.96)
    assert planning.drafted_per_step({**rec, "vllm": {**vllm, "draft_tokens": 800}}) is None  # sends k
    assert planning.drafted_per_step({**rec, "vllm": {**vllm, "drafts": 0}}) is None
    prefix, _ = planning.drafting(rec)
    p16 = profiles[16]
    for k, scored in ((1, 1.0), (4, 1.96), (8, 1.96)):
        tokens = 1 + rate * sum(per_draft[:k])
        seconds = p16.latency(1) + rate * (p16.latency(1 + scored) - p16.latency(1))
        assert planning.predicted_tokens_per_s(prefix, p16, 16, k, rate=rate, sent=1.96) == pytest.approx(
            16 * tokens / seconds)
    plan = planning.plan_method("suffix", rec, profiles, [1, 16], 8, {})
    as_if_k = planning.plan_method("suffix", {**rec, "vllm": {**vllm, "draft_tokens": 800}}, profiles, [1, 16], 8, {})
    assert plan["drafted_per_step"] == pytest.approx(1.96) and as_if_k["drafted_per_step"] is None
    assert plan["predicted"][16] > as_if_k["predicted"][16] and plan["per_level"][16] >= as_if_k["per_level"][16]


def test_a_costly_drafter_drafts_less_under_load():
    levels = [1, 16]
    profiles = _profiles(levels, per_token_s=0.01)
    rec = {"accuracy": [[0.8]] * 8, "guesser": {"draft_passes": "depth"}}
    cheap = planning.plan_method("draft_model", rec, profiles, levels, 8, {1: 0.0, 16: 0.0})
    costly = planning.plan_method("draft_model", rec, profiles, levels, 8, {1: 0.03, 16: 0.03})
    assert costly["per_level"][1] <= cheap["per_level"][1]
    assert costly["per_level"][16] < cheap["per_level"][1]


@pytest.mark.parametrize("acc, plan_at_1, plan_at_16", [
    ([0.3, 0.2, 0.1, 0, 0, 0, 0, 0], 2, 1),  # K = 1 at 16 (0.935x plain) beats a schedule's K = 0 (0.92x)
    ([0.1, 0, 0, 0, 0, 0, 0, 0], 0, 0),  # 1.059x at 1 cannot pay for 0.92x at 16: no speculative config
])
def test_a_schedules_k0_is_priced_at_the_engines_off_ratio(acc, plan_at_1, plan_at_16):
    """vLLM keeps its speculative path where a schedule's K is 0 (0.81-1.07x plain measured here), so the
    planner prices K = 0 inside a schedule at off_ratio x plain: a short draft that loses a little beats it,
    and a schedule predicted below plain over the levels is plain itself. Checked against every length
    priced by predicted_tokens_per_s."""
    levels = [1, 16]
    profiles = _profiles(levels)
    rec = {"accuracy": [[x] for x in acc], "guesser": {"draft_passes": "one"}}
    old = planning.plan_method("ngram", rec, profiles, levels, 8, {})
    plan = planning.plan_method("ngram", rec, profiles, levels, 8, {}, off_ratio=0.92)
    assert plan["per_level"] == {1: plan_at_1, 16: plan_at_16} and old["per_level"][16] == 0
    prefix = np.cumprod(acc)
    plain = {b: planning.predicted_tokens_per_s(prefix, profiles[b], b, 0) for b in levels}
    for b in levels:
        rates = [planning.predicted_tokens_per_s(prefix, profiles[b], b, k) for k in range(9)]
        if plan_at_1:  # a schedule: each level its best length, K = 0 at 0.92x plain
            assert plan["per_level"][b] == int(np.argmax([0.92 * rates[0]] + rates[1:]))
            assert plan["predicted"][b] == pytest.approx(max([0.92 * rates[0]] + rates[1:]), rel=1e-9)
        else:
            assert plan["predicted"][b] == pytest.approx(plain[b], rel=1e-9)
    assert not plan_at_1 or old["per_level"][1] == plan_at_1


def test_schedule_ranges():
    assert planning.schedule_ranges({1: 4, 2: 4, 4: 2, 8: 0, 16: 0}, [1, 2, 4, 8, 16]) == \
        [[1, 3, 4], [4, 7, 2], [8, planning.MAX_CONCURRENCY, 0]]
    assert planning.schedule_ranges({4: 3}, [4]) == [[1, planning.MAX_CONCURRENCY, 3]]


def _level(c: int, seconds: list[float], tokens: list[list[int]]):
    recs = [RequestRecord(i, 0.0, ttft_s=0.01, token_times_s=[0.01, s], latency_s=s, output_tokens=len(t),
                          token_ids=list(t)) for i, (s, t) in enumerate(zip(seconds, tokens))]
    return [{"result": LoadResult(c, max(seconds), recs), "counters": SpecDecodeCounters()}]


def test_the_paired_rule_per_level():
    rng = np.random.default_rng(0)
    n = 12
    toks = [[i, i + 1, i + 2, i + 3] for i in range(n)]
    plain = list(1.0 + 0.3 * rng.random(n))
    results = {
        sr.PLAIN: {1: _level(1, plain, toks)},
        "fast": {1: _level(1, [x / 1.5 for x in plain], toks)},
        "noise": {1: _level(1, [x * (1.0 + 0.05 * rng.standard_normal()) for x in plain], toks)},
        "faster but wrong": {1: _level(1, [x / 3 for x in plain], [t[:3] + [99] for t in toks])},
    }
    lv = sr.decide_level(results, 1, greedy=True)
    assert lv["winner"] == "fast"
    assert lv["contenders"]["fast"]["paired"]["lo"] > 1.0
    assert lv["contenders"]["faster but wrong"]["mismatches"] == n
    assert lv["contenders"]["noise"]["paired"]["lo"] <= 1.0
    # without the right contender, noise does not win: plain
    del results["fast"]
    assert sr.decide_level(results, 1, greedy=True)["winner"] == sr.PLAIN


def _on_server(rounds: list[dict], server: int, closing: bool = False) -> list[dict]:
    return [{**r, "server": server, "closing": closing} for r in rounds]


def test_a_level_resolves_across_servers_not_within_one():
    """Two servers ran the same plain path at 16 requests here and said 1.03x and 0.79x, each interval
    tight: the requests of one server share its state. A level's interval is widened by the spread
    between servers, so 3 % on one server each is not a decision, a 50 % gain is, and passes that add
    servers narrow it; plain's own servers teach the race how far its servers disagree."""
    n = 12
    toks = [[i, i + 1] for i in range(n)]
    plain = [1.0 + 0.02 * i for i in range(n)]
    results = {sr.PLAIN: {16: _on_server(_level(16, plain, toks), 1)},
               "a little": {16: _on_server(_level(16, [x / 1.03 for x in plain], toks), 2)},
               "a lot": {16: _on_server(_level(16, [x / 1.5 for x in plain], toks), 3)}}
    rows = sr.decide_level(results, 16, greedy=True)["contenders"]
    little = rows["a little"]["paired"]
    assert little["within"][0] > 1.0 and little["lo"] < 1.0 < little["hi"]  # tight per request, open across servers
    assert not rows["a little"]["resolved"] and little["servers"] == [1, 1]
    assert sr.beats_plain(rows["a lot"]) and rows["a lot"]["paired"]["lo"] > 1.0
    assert sr.server_spread(results[sr.PLAIN]) == pytest.approx(sr.SERVER_SPREAD)  # one plain server: the prior

    # more servers of each, all agreeing: the spread learnt from plain's servers falls, the interval narrows
    results[sr.PLAIN][16] += [r for s in (4, 5, 6, 7) for r in _on_server(_level(16, plain, toks), s, closing=True)]
    results["a little"][16] += [r for s in (8, 9, 10) for r in _on_server(_level(16, [x / 1.03 for x in plain], toks), s)]
    assert sr.server_spread(results[sr.PLAIN]) < sr.SERVER_SPREAD
    again = sr.decide_level(results, 16, greedy=True)["contenders"]["a little"]["paired"]
    assert again["servers"] == [4, 5] and again["hi"] - again["lo"] < little["hi"] - little["lo"]
    # plain's servers that disagree widen it instead
    results[sr.PLAIN][16] = _on_server(_level(16, plain, toks), 1) + _on_server(_level(16, [x * 1.3 for x in plain], toks), 4)
    assert sr.server_spread(results[sr.PLAIN]) > sr.SERVER_SPREAD


def _row(ratio, lo=None, mismatches=0):
    """A contender's row at a level: tokens/s over plain, the paired interval (around the ratio by default)."""
    lo = ratio - 0.03 if lo is None else lo
    return {"vs_plain": ratio, "mismatches": mismatches, "paired": {"lo": lo, "mean": ratio, "hi": ratio + 0.03}}


def test_ahead_of_plain_needs_the_paired_interval_and_the_throughput_and_no_changed_token():
    assert sr.beats_plain(_row(1.2))
    assert not sr.beats_plain(_row(1.2, lo=0.98))  # within the noise per request
    assert not sr.beats_plain(_row(0.85, lo=1.005))  # per-request faster, level slower (seen at 16 here)
    assert not sr.beats_plain(_row(1.2, mismatches=1))


def test_the_decision_keeps_speculation_where_it_beat_plain_though_another_won():
    """ngram beat plain at 1 where suffix won; suffix is out (one length, behind at 16): ngram keeps its
    K at 1, and is off only at 16, where it was behind plain."""
    levels = [1, 4, 16]
    cs = [sr.Contender(sr.PLAIN, None), sr.Contender("suffix defaults", {"method": "suffix"}),
          sr.Contender("ngram defaults", {"method": "ngram", "num_speculative_tokens": 4})]
    out = [{"level": 1, "winner": "suffix defaults", "contenders": {"suffix defaults": _row(1.58), "ngram defaults": _row(1.32)}},
           {"level": 4, "winner": "ngram defaults", "contenders": {"suffix defaults": _row(0.87), "ngram defaults": _row(1.23)}},
           {"level": 16, "winner": sr.PLAIN, "contenders": {"suffix defaults": _row(0.6), "ngram defaults": _row(0.85, 1.005)}}]
    chosen, why = sd.decision(cs, out, levels)
    assert why["winner"] == "ngram defaults" and why["draft_length_by_level"] == {1: 4, 4: 4, 16: 0}
    assert chosen.speculative["num_speculative_tokens_per_batch_size"] == [[1, 15, 4], [16, 256, 0]]


def test_the_decision_switches_speculation_off_where_it_lost():
    levels = [1, 4, 16]
    cs = [sr.Contender(sr.PLAIN, None), sr.Contender("planned ngram", {
        "method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 3, 4], [4, 256, 2]]})]

    def lv(level, winner, ratio):
        return {"level": level, "winner": winner, "contenders": {sr.PLAIN: {"vs_plain": 1.0},
                                                                  "planned ngram": _row(ratio)}}

    chosen, why = sd.decision(cs, [lv(1, "planned ngram", 1.3), lv(4, "planned ngram", 1.1), lv(16, sr.PLAIN, 0.95)],
                              levels)
    assert why["levels_ahead_of_plain"] == [1, 4] and why["draft_length_by_level"] == {1: 4, 4: 2, 16: 0}
    assert chosen.speculative["num_speculative_tokens_per_batch_size"] == [[1, 3, 4], [4, 15, 2], [16, 256, 0]]
    assert chosen.speculative["num_speculative_tokens"] == 4
    none, why = sd.decision(cs, [lv(x, sr.PLAIN, 0.9) for x in levels], levels)
    assert none is None and why["winner"] == sr.PLAIN


def test_a_tie_keeps_the_draft_length_and_only_a_loss_switches_it_off():
    """A schedule's K = 0 is not plain in vLLM, so a level where the winner tied plain keeps its length
    (the decision is then the raced config itself, nothing to confirm); one where it lost goes to 0."""
    levels = [1, 4, 16]
    raced = {"method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 3, 4], [4, 256, 2]]}
    cs = [sr.Contender(sr.PLAIN, None), sr.Contender("planned ngram", dict(raced))]

    def lv(level, winner, row):
        return {"level": level, "winner": winner, "contenders": {sr.PLAIN: {"vs_plain": 1.0}, "planned ngram": row}}

    tie = _row(0.99, lo=0.95)  # interval 0.95..1.02 and 0.99x tokens/s: neither ahead nor behind
    assert not sr.beats_plain(tie) and not sr.behind_plain(tie)
    chosen, why = sd.decision(cs, [lv(1, "planned ngram", _row(1.3)), lv(4, "planned ngram", _row(1.1)),
                                   lv(16, sr.PLAIN, tie)], levels)
    assert chosen.speculative == raced and why["levels_behind_plain"] == []
    assert why["draft_length_by_level"] == {1: 4, 4: 2, 16: 2}
    for lost in (_row(0.97, lo=0.95), _row(0.99, lo=0.9) | {"paired": {"lo": 0.9, "mean": 0.95, "hi": 0.99}},
                 _row(1.1, mismatches=1), None):
        assert sr.behind_plain(lost)
        chosen, why = sd.decision(cs, [lv(1, "planned ngram", _row(1.3)), lv(4, "planned ngram", _row(1.1)),
                                       lv(16, sr.PLAIN, lost)], levels)
        assert why["levels_behind_plain"] == [16]
        assert chosen.speculative["num_speculative_tokens_per_batch_size"] == [[1, 3, 4], [4, 15, 2], [16, 256, 0]]
    # a one-length proposer that ties somewhere and is ahead elsewhere is a candidate, and written as raced
    suffix = [sr.Contender(sr.PLAIN, None), sr.Contender("suffix defaults", {"method": "suffix"})]
    out = [{"level": x, "winner": w, "contenders": {sr.PLAIN: {"vs_plain": 1.0}, "suffix defaults": r}}
           for x, w, r in ((1, "suffix defaults", _row(1.4)), (4, sr.PLAIN, tie), (16, "suffix defaults", _row(1.1)))]
    chosen, why = sd.decision(suffix, out, levels)
    assert chosen.speculative == {"method": "suffix"} and why["winner"] == "suffix defaults"


def test_exports_carry_the_same_schedule(tmp_path):
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
           "num_speculative_tokens_per_batch_size": [[1, 3, 4], [4, 15, 2], [16, 256, 0]]}
    sv._exports(sr.Contender("planned ngram", cfg), tmp_path, {})
    assert json.loads((tmp_path / "exports" / "vllm.json").read_text())["speculative_config"] == cfg
    trt = json.loads((tmp_path / "exports" / "trtllm.json").read_text())["speculative_config"]
    # planner/export.py's TensorRT-LLM builder: keyed by each range's highest batch size, 0 above the last key
    assert trt == {"decoding_type": "NGram", "max_draft_len": 4, "max_total_draft_tokens": 4,
                   "draft_len_schedule": {"3": 4, "15": 2}, "max_concurrency": 15}
    sglang = json.loads((tmp_path / "exports" / "sglang.json").read_text())
    assert sglang["server_args"][:2] == ["--speculative-algorithm", "NGRAM"]
    assert any("per-batch-size" in n or "batch size" in n for n in sglang["notes"]), sglang["notes"]
    sv._exports(sr.Contender("planned suffix", {"method": "suffix", "num_speculative_tokens": 3}), tmp_path, {})
    notes = json.loads((tmp_path / "exports" / "notes.json").read_text())["notes"]
    assert any(n.startswith("trtllm: no suffix proposer") for n in notes), notes


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "planner", "autotune", "--engine", "vllm", *args],
                          check=False, capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize("args, expect", [
    (["--concurrency", "1,x"], "--concurrency: expected comma-separated integers"),
    (["--concurrency", "4,2"], "--concurrency: expected increasing integers"),
    (["--concurrency", "1,1000"], "--concurrency: expected increasing integers in 1..256"),
    (["--guessers", "lookup"], "--methods: expected a subset of ngram,suffix,draft_model"),
    (["--turns", "2"], "--turns: not with --engine vllm"),
    (["--decode-prompts", "4"], "--decode-prompts: expected an integer in 5..4096"),
])
def test_bad_flags_are_one_line(args, expect, tmp_path):
    r = _cli(*args, "--out", str(tmp_path / "run"))
    assert r.returncode != 0 and expect in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_a_malformed_workload_line_is_refused_before_anything_starts(tmp_path):
    ws = tmp_path / "w.jsonl"
    ws.write_text('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}\n{"messages": "oops"}\n')
    r = _cli("--workload", str(ws), "--out", str(tmp_path / "run"))
    assert r.returncode != 0 and f"{ws}: line 2" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_export_writes_the_project_draft_as_a_model_folder(tmp_path):
    """`planner export --method draft_model --draft-model <the project's draft LM>` writes the folder vLLM's
    draft_model method loads beside the config, and the config names it."""
    from smollm2_drafts import smollm2_draft_lm

    out = tmp_path / "vllm.json"
    draft = smollm2_draft_lm(tmp_path / "draft_lm", layers=2)
    r = subprocess.run([sys.executable, "-m", "planner", "export", "--engine", "vllm",
                        str(ROOT / "trees" / "autotune-cpu-smollm2-135m.json"), "--method", "draft_model",
                        "--draft-model", str(draft), "-o", str(out)],
                       check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    cfg = json.loads(out.read_text())["speculative_config"]
    folder = Path(cfg["model"])
    assert folder == (tmp_path / "vllm.draft").resolve() and cfg["method"] == "draft_model"
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 2
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


def test_a_proposer_that_learns_from_answers_gets_a_fresh_server_per_pass(monkeypatch):
    """suffix decoding drafts from earlier answers: racing it on the same requests at a second level on
    the same server would draft them from its own first pass. Without the plugin it gets a server per pass;
    with it, one server whose every reset must also make it forget them. Other contenders keep one server."""
    import contextlib

    import profiler.load_generator as lg
    import profiler.serving_metrics as sm
    from profiler.workload import Request

    starts, sent, lengths = [], [], []

    class Server:
        url, served_model_name = "http://127.0.0.1:1", "m"

        def reset_prefix_cache(self, forget_answers=False):
            sent.append("fresh and forget" if forget_answers else "fresh")

    class Engine:
        @contextlib.contextmanager
        def server(self, speculative_config=None, plugin=False):
            starts.append(speculative_config)
            yield Server()

    monkeypatch.setattr(lg, "run_load", lambda url, m, reqs, c, t: sent.append((c, len(reqs))) or
                        lengths.append({r.max_tokens for r in reqs}) or
                        LoadResult(c, 1.0, [RequestRecord(i, 0.0, output_tokens=2) for i in range(len(reqs))]))
    monkeypatch.setattr(sm, "fetch_spec_decode", lambda url: SpecDecodeCounters())
    reqs = [Request([{"role": "user", "content": f"q{i}"}], 32) for i in range(3)]
    warm = [Request([{"role": "user", "content": "warm"}], 32)]
    s = sv.ServingSettings(rounds=2)
    suffix = {"method": "suffix"}
    for cfg, plugin, servers in ((suffix, True, 1), (suffix, False, 6), ({"method": "ngram", "num_speculative_tokens": 2},
                                                                       False, 1), (None, False, 1)):
        starts.clear()
        traffic = sr.same_requests(reqs, sr.warm_requests(warm, s.sampling, 0), [1, 4, 16], s.rounds, None, 60.0)
        race = sr.Race(traffic, [1, 4, 16], lambda line: None)
        results = race.results
        sr.race_contender(Engine(), sr.Contender("c", cfg, plugin=plugin), race)
        assert len(starts) == servers and sorted(results["c"]) == [1, 4, 16]
        assert all(len(results["c"][lv]) == 2 for lv in (1, 4, 16))
        if cfg is suffix and plugin:  # one server: every pass's reset makes it forget
            assert [x for x in sent if isinstance(x, str)] == ["fresh and forget"] * 6
            sent.clear()
    # every pass: an empty prefix cache (a pass repeats the race's prompts), a warm-up wave of `level`
    # short requests outside the race, then the 3 race requests
    assert sent[-18:] == ["fresh", (1, 1), (1, 3), "fresh", (1, 1), (1, 3), "fresh", (4, 4), (4, 3), "fresh", (4, 4),
                          (4, 3), "fresh", (16, 16), (16, 3), "fresh", (16, 16), (16, 3)]
    assert lengths[-12:] == [{sr.WARMUP_TOKENS}, {32}] * 6  # the warm-up's answers short, the race's whole


def test_a_proposer_vllm_runs_at_one_length_is_planned_and_chosen_as_one_length():
    """vLLM 0.32's suffix proposer asserts the step's draft length is its configured one, so a per-batch-size
    schedule kills its worker at the first switch: its plan is its best fixed length at every level, and
    the decision takes it only where it won every level (it cannot be switched off where it lost)."""
    from planner.export import SCHEDULE_METHODS

    assert "suffix" not in SCHEDULE_METHODS["vllm"] and {"ngram", "draft_model"} <= SCHEDULE_METHODS["vllm"]
    levels = [1, 16]
    profiles = _profiles(levels, per_token_s=0.01)
    rec = {"accuracy": [[0.8]] * 8, "guesser": {"draft_passes": "one"}}
    free = planning.plan_method("suffix", rec, profiles, levels, 8, {})
    fixed = planning.plan_method("suffix", rec, profiles, levels, 8, {}, schedulable=False)
    assert len(set(free["per_level"].values())) > 1  # the model would switch lengths under load
    assert set(fixed["per_level"].values()) == {free["best_fixed"]} and fixed["predicted"] == free["fixed_predicted"]

    cs = [sr.Contender(sr.PLAIN, None), sr.Contender("suffix defaults", {"method": "suffix"}),
          sr.Contender("ngram defaults", {"method": "ngram", "num_speculative_tokens": 4})]

    def lv(level, winner, ratios):
        return {"level": level, "winner": winner,
                "contenders": {sr.PLAIN: {"vs_plain": 1.0}, "suffix defaults": _row(ratios[0]),
                               "ngram defaults": _row(ratios[1])}}

    # suffix wins at 1 and 4, ngram only at 16: suffix cannot be switched off at 16, so ngram is chosen
    out = [lv(1, "suffix defaults", (1.5, 1.2)), lv(4, "suffix defaults", (1.2, 1.1)), lv(16, "ngram defaults", (0.8, 1.05))]
    chosen, why = sd.decision(cs, out, [1, 4, 16])
    assert why["winner"] == "ngram defaults" and why["draft_length_by_level"] == {1: 4, 4: 4, 16: 4}
    assert "num_speculative_tokens_per_batch_size" not in chosen.speculative
    # suffix everywhere: chosen as it is, one length
    out = [lv(x, "suffix defaults", (1.3, 1.1)) for x in (1, 4, 16)]
    chosen, why = sd.decision(cs, out, [1, 4, 16])
    assert why["winner"] == "suffix defaults" and "num_speculative_tokens_per_batch_size" not in chosen.speculative
    # suffix alone, winning some levels only: plain
    chosen, why = sd.decision(cs[:2], [lv(1, "suffix defaults", (1.3, 0.9)), lv(4, sr.PLAIN, (0.9, 0.9))], [1, 4])
    assert chosen is None and why["winner"] == sr.PLAIN


def test_vllm_export_of_a_suffix_schedule_without_the_plugin_writes_one_length_and_says_why(tmp_path):
    from planner.export import DraftRange, ExportOptions, build
    from planner.tree import Tree, TreeState

    chain = Tree("medusa", [TreeState(0, [(0,) * i for i in range(1, 4)], 1.0, 4)], 1.0)
    ranges = [DraftRange(1, 7, 3), DraftRange(8, 256, 0)]
    ngram = build(chain, ranges, ExportOptions("vllm", "ngram"), {}, [])
    assert ngram.to_json()["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 7, 3], [8, 256, 0]]
    planned = build(chain, ranges, ExportOptions("vllm", "suffix"), {}, []).to_json()  # with the plugin: a schedule
    assert planned["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 7, 3], [8, 256, 0]]
    suffix = build(chain, ranges, ExportOptions("vllm", "suffix", plugin=False), {}, []).to_json()
    assert "num_speculative_tokens_per_batch_size" not in suffix["speculative_config"]
    assert suffix["speculative_config"]["num_speculative_tokens"] == 3
    assert any("takes one draft length" in n and "8-256" in n for n in suffix["notes"]), suffix["notes"]


def test_a_contender_whose_server_dies_is_out_and_the_race_goes_on(monkeypatch, tmp_path):
    """A config vLLM accepts and then fails on (its worker dies mid-race): that contender is recorded as
    failed and left out of the decision; the other contenders still race and race.json is written."""
    calls = []

    def fake_race(engine, c, race, levels=None, into=None):
        results, levels = race.results, list(levels or race.levels)
        calls.append(c.name)
        if c.speculative and c.speculative.get("num_speculative_tokens_per_batch_size"):
            raise sr.UserError("http://127.0.0.1:1/metrics: cannot read the server's metrics (Connection refused)")
        for lv in levels:
            ok = [RequestRecord(i, 0.0, latency_s=1.0, output_tokens=4, token_ids=[1, 2, 3, 4]) for i in range(4)]
            results.setdefault(c.name, {})[lv] = [{"result": LoadResult(lv, 1.0, ok), "counters": SpecDecodeCounters()}]

    monkeypatch.setattr(sr, "race_contender", fake_race)
    cs = [sr.Contender(sr.PLAIN, None), sr.Contender("planned ngram", {
        "method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 3, 4], [4, 256, 0]]}),
        sr.Contender("ngram defaults", {"method": "ngram", "num_speculative_tokens": 4})]
    failed, results = sr.race_all(None, cs, sr.Race(sr.Traffic({}, []), [1, 4], lambda line: None))
    assert calls == [sr.PLAIN, "planned ngram", "ngram defaults"]
    assert list(failed) == ["planned ngram"] and "Connection refused" in failed["planned ngram"]
    assert sorted(results) == ["ngram defaults", sr.PLAIN]


def test_plain_closes_the_race_and_each_ratio_is_to_the_median_of_its_two_servers(monkeypatch):
    """Plain runs again after the contenders: its rounds join the first server's, a contender's ratio and
    paired interval are taken against the median of the two, and the drift between them is recorded;
    a closing server that fails leaves the first one's rows as they were."""
    n, toks = 8, [[1, 2, 3, 4]] * 8
    results = {sr.PLAIN: {1: _level(1, [2.0] * n, toks)}, "spec": {1: _level(1, [1.25] * n, toks)}}

    def closing(engine, c, race, levels=None, into=None):
        assert c.name == sr.CLOSING and c.speculative is None
        race.results.setdefault(c.name, {})[1] = _level(1, [1.0] * n, toks)  # the machine sped up during the race

    monkeypatch.setattr(sr, "race_contender", closing)
    race = sr.Race(sr.Traffic({}, []), [1], lambda line: None, results=results)
    failed = race.failed
    sr.close_plain(None, race)
    assert not failed and len(results[sr.PLAIN][1]) == 2 and results[sr.PLAIN][1][1]["closing"]
    lv = sr.decide_level(results, 1, greedy=True)
    plain, spec = lv["contenders"][sr.PLAIN], lv["contenders"]["spec"]
    assert plain["drift"] == pytest.approx(2.0)  # tokens/s: the second server's over the first's
    assert plain["output_tokens_per_s"] == pytest.approx((16 + 32) / 2)  # 32 tokens in 2.0 s and in 1.0 s
    assert spec["vs_plain"] == pytest.approx(25.6 / 24)  # against the median of the two, not the first alone
    assert spec["paired"]["mean"] == pytest.approx(1.5 / 1.25)  # per request: the two servers' median
    before = [dict(r) for r in results[sr.PLAIN][1]]

    def dies(engine, c, race, levels=None, into=None):
        raise sr.UserError("no request completed at concurrency 1: the worker died")

    monkeypatch.setattr(sr, "race_contender", dies)
    sr.close_plain(None, race)
    assert "the worker died" in failed[sr.CLOSING] and results[sr.PLAIN][1] == before
    assert sr.plain_drift(_level(1, [1.0] * n, toks)) is None  # one server: no drift to speak of


def test_raced_tokens_per_step_count_steps_as_the_acceptance_records_do():
    """A request's last step may accept drafts past max_tokens, which vLLM counts and then cuts, so decoded -
    accepted undercounts the steps; the streamed chunks bound them too, and the race's tokens per step
    (beside the price in the report) takes the larger bound, as the acceptance records do. Measured on the
    race half of the held-out questions, ngram K = 8: 2.20 tokens per step counted so, 2.41 by tokens alone."""
    n, toks = 4, list(range(8))
    recs = [RequestRecord(i, 0.0, ttft_s=0.01, token_times_s=[0.01, 0.1, 0.1, 0.2, 0.3, 0.4, 0.5, 0.5], latency_s=0.5,
                          output_tokens=8, token_ids=toks) for i in range(n)]  # 6 chunks: 5 steps after the prefill
    spec = SpecDecodeCounters(drafts=20, draft_tokens=60, accepted_tokens=12, speculating=True)
    results = {sr.PLAIN: {4: _level(4, [1.0] * n, [toks] * n)},
               "spec": {4: [{"result": LoadResult(4, 0.5, recs), "counters": spec}]}}
    row = sr.decide_level(results, 4, greedy=True)["contenders"]["spec"]
    assert row["steps"] == 20  # chunks: 4 x 5; by tokens only 4 x 7 - 12 = 16
    c = sr.Contender("spec", {"method": "ngram", "num_speculative_tokens": 8}, {4: 1.0},
                     {4: {"tokens_per_step": 1.5, "step_s": 0.1}})
    parts = sv.prediction_parts([c], [{"level": 4, "contenders": {"spec": row}}])
    assert parts["spec"][4]["tokens_per_step"] == [1.5, pytest.approx(28 / 20)]


def test_the_servers_own_cost_per_step_is_recovered_from_plain_and_priced_into_every_step():
    """vLLM plain through the server runs one token per request per step, so b / its tokens/s is the
    server's step: the profile's plus the server's own cost (server_overhead recovers a known one).
    Priced steps pay it too (by enumeration), and a larger fixed cost per step never shortens the
    planned draft (drafting's marginal cost is unchanged while a step's base grows)."""
    levels = [1, 4, 16]
    profiles = _profiles(levels, per_token_s=0.004)
    true = {1: 0.03, 4: 0.05, 16: 0.12}
    plain = {b: b / (profiles[b].latency(1) + true[b]) for b in levels}
    got = planning.server_overhead(profiles, plain, levels)
    assert got == pytest.approx(true, rel=1e-9)
    faster = {b: 1.2 * b / profiles[b].latency(1) for b in levels}  # noise cannot make the server cheaper
    assert planning.server_overhead(profiles, faster, levels) == {b: 0.0 for b in levels}
    assert planning.server_overhead(profiles, {1: plain[1]}, levels)[16] == 0.0  # not measured: no cost

    acc = [0.7, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1]
    rec = {"accuracy": [[x] for x in acc], "guesser": {"draft_passes": "one"}}
    prefix = np.cumprod(acc)
    for b in levels:
        for k in range(4):
            seconds = profiles[b].latency(1 + k) + true[b]
            assert planning.predicted_tokens_per_s(prefix, profiles[b], b, k, overhead_s=true[b]) == \
                pytest.approx(b * planning.chain_rate(acc, k) / seconds)
    bare = planning.plan_method("ngram", rec, profiles, levels, 8, {})
    served = planning.plan_method("ngram", rec, profiles, levels, 8, {}, overhead_s=true)
    assert served["plain_predicted"] == pytest.approx(plain, rel=1e-9)
    assert all(served["per_level"][b] >= bare["per_level"][b] for b in levels)
    assert any(served["per_level"][b] > bare["per_level"][b] for b in levels), (bare["per_level"], served["per_level"])


def test_the_autotune_races_plain_first_and_plans_on_the_servers_measured_cost(monkeypatch, tmp_path):
    """Phase 3 runs vLLM plain through the server before planning: the plan (and every prediction in
    race.json) is priced on the profile plus the cost per step plain's pass measured, and the other
    contenders race after it. A planned length equal to a stock setting races once, with its prediction."""
    levels = [1, 4, 16]
    true = {1: 0.03, 4: 0.05, 16: 0.4}
    exported = []  # the exports are checked by vLLM (slow): collected instead
    profiles, rec = _faked_inputs(monkeypatch, tmp_path, levels, ("ngram",), exported)
    raced = []

    def fake_race(engine, c, race, lvls=None, into=None):
        results, lvls = race.results, list(lvls or race.levels)
        sizes = {lv: len(race.traffic.requests[(lv, 0)]) for lv in lvls}
        raced.append(c.name)
        for lv in lvls:
            k = 0 if c.speculative is None else sd.k_by_level(c.speculative, [lv])[lv]
            gain = 1.0 if k == 0 else (1.5 if lv < 16 else 0.7)  # speculation loses at 16, beyond the server spread
            tps = lv / (profiles[lv].latency(1) + true[lv]) * gain
            recs = [RequestRecord(i, 0.0, latency_s=(1 + 0.1 * i) * lv / tps, output_tokens=8, token_ids=list(range(8)))
                    for i in range(6)]
            results.setdefault(c.name, {})[lv] = [{"result": LoadResult(lv, 48 / tps, recs),
                                                   "counters": SpecDecodeCounters()}]

    monkeypatch.setattr(sr, "race_contender", fake_race)
    s = sv.ServingSettings(concurrency=tuple(levels), methods=("ngram",), out=str(tmp_path / "run"), quiet=True,
                           race_requests=6, accept_requests=2)
    autotune(s)
    assert raced[0] == sr.PLAIN and raced.count(sr.PLAIN) == 1 and len(raced) >= 3
    plans = json.loads((tmp_path / "run" / "plans.json").read_text())
    assert {int(k): v for k, v in plans["server_overhead_s"].items()} == pytest.approx(true, rel=1e-6)
    expect = planning.plan_method("ngram", rec, profiles, levels, max(s.draft_lengths), {}, overhead_s=true)
    race = json.loads((tmp_path / "run" / "race.json").read_text())
    predicted = {c["name"]: c["predicted_tokens_per_s"] for c in race["contenders"]}
    assert not predicted[sr.PLAIN]
    fixed = [n for n in predicted if n.startswith("fixed") or n == "ngram defaults" and predicted[n]]
    assert fixed, predicted
    for lv in levels:
        assert predicted[fixed[0]][str(lv)] == pytest.approx(expect["fixed_predicted"][lv], rel=1e-9)
    # speculation lost at 16, so the decision switches it off there: a config no contender ran, raced last
    chosen = json.loads((tmp_path / "run" / "chosen.json").read_text())
    assert chosen["speculative_config"]["num_speculative_tokens_per_batch_size"][-1] == [16, planning.MAX_CONCURRENCY, 0]
    assert raced[-1] == sr.DECISION and chosen["decision"]["measured_as"] == sr.DECISION
    assert exported[0].speculative == chosen["speculative_config"]
    assert chosen["decision"]["vs_plain_by_level"]["16"] == pytest.approx(1.0)
    assert chosen["decision"]["vs_plain_by_level"]["1"] == pytest.approx(1.5)
    race = json.loads((tmp_path / "run" / "race.json").read_text())
    assert all(sr.DECISION in lv["contenders"] for lv in race["levels"])
    assert sr.DECISION in (tmp_path / "run" / "report.md").read_text()


def test_a_level_where_no_request_completes_fails_the_contender_with_vllms_reason(monkeypatch):
    """vLLM 0.32's CPU worker died mid-level under seeded sampling with suffix decoding at 16 requests
    (RuntimeError: CPU Generator does not use offset) while its API server still answered: every request
    errored. That contender is failed with vLLM's reason, not raced on at 0 tokens/s."""
    import contextlib

    import profiler.load_generator as lg
    import profiler.serving_metrics as sm
    from profiler.workload import Request

    class Engine:
        @contextlib.contextmanager
        def server(self, speculative_config=None, plugin=False):
            yield type("S", (), {"url": "http://127.0.0.1:1", "served_model_name": "m",
                                 "why_stopped": lambda self: "RuntimeError: CPU Generator does not use offset"})()

    def load(url, m, reqs, c, t):
        dead = c >= 16
        return LoadResult(c, 1.0, [RequestRecord(i, 0.0, output_tokens=0 if dead else 2,
                                                 error="HTTP 500: EngineDeadError" if dead else None)
                                   for i in range(len(reqs))])

    monkeypatch.setattr(lg, "run_load", load)
    monkeypatch.setattr(sm, "fetch_spec_decode", lambda url: SpecDecodeCounters())
    reqs = [Request([{"role": "user", "content": f"q{i}"}], 4) for i in range(3)]
    cs = [sr.Contender(sr.PLAIN, None), sr.Contender("suffix defaults", {"method": "suffix"})]
    with pytest.raises(sr.UserError, match="no request completed at concurrency 16: RuntimeError: CPU Generator"):
        sr.race_all(Engine(), cs[:1], _race(reqs, [1, 16]))
    failed, results = sr.race_all(Engine(), cs[1:], _race(reqs, [1, 16]))
    assert "CPU Generator does not use offset" in failed["suffix defaults"] and "suffix defaults" not in results


def _race(reqs, levels):
    return sr.Race(sr.same_requests(reqs, reqs[:1], levels, 1, None, 60.0), levels, lambda line: None)


def test_a_confirmed_decision_that_is_not_ahead_over_the_levels_falls_back_to_plain():
    """Measured on sampled traffic here: ngram at one request only, K = 0 by schedule elsewhere, which
    vLLM still runs as speculation: 1.06 / 0.92 / 0.96 / 0.90 / 0.88x, so plain is the better config."""
    assert not sd.ahead_over_range({1: 1.06, 2: 0.92, 4: 0.96, 8: 0.90, 16: 0.88})
    assert sd.ahead_over_range({1: 1.36, 2: 1.39, 4: 1.17, 8: 0.91, 16: 1.07})
    assert not sd.ahead_over_range({1: None, 2: None}) and not sd.ahead_over_range({1: 0.0, 2: 3.0})


def test_racing_a_contender_is_priced_from_plains_race():
    """A contender's predicted race time: its servers at plain's start time (a proposer that learns from
    answers needs one per pass), and each level at plain's time scaled by plain's over its predicted
    tokens/s."""
    plain = {"start_s": [50.0], "level_s": {1: [60.0], 4: [30.0]}, "wall_s": 140.0}
    tps = {1: 10.0, 4: 20.0}
    ngram = sr.Contender("n", {"method": "ngram", "num_speculative_tokens": 2}, {1: 20.0, 4: 10.0})
    assert sr.predicted_seconds(ngram, plain, [1, 4], 1, tps) == pytest.approx(50 + 60 / 2 + 30 * 2)
    assert sr.predicted_seconds(sr.Contender("s", {"method": "suffix"}), plain, [1, 4], 1, tps) == \
        pytest.approx(2 * 50 + 90)
    assert sr.predicted_seconds(sr.Contender("s", {"method": "suffix"}), {"start_s": [50.0], "level_s": {
        1: [60.0, 62.0], 4: [30.0, 28.0]}}, [1, 4], 2, tps) == pytest.approx(4 * 50 + 180)
    assert sr.predicted_seconds(sr.Contender("s", {"method": "suffix"}, plugin=True), plain, [1, 4], 1, tps) == \
        pytest.approx(50 + 90)  # with the plugin: one server, each reset makes it forget
    assert sr.predicted_seconds(sr.Contender("x", {"method": "ngram"}), {"wall_s": 140.0}, [1, 4], 1, tps) == \
        pytest.approx(140.0)  # no detail (a fake race): plain's wall time
    schedule = {"method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 3, 4],
                                                                                                       [4, 256, 1]]}
    order = sr.race_order([sr.Contender("suffix", {"method": "suffix"}), sr.Contender("stock", {"method": "ngram"}),
                           ngram, sr.Contender("planned", schedule, {1: 5.0, 4: 5.0})], plain, [1, 4], 1, tps)
    assert [c.name for c, _ in order] == ["planned", "n", "stock", "suffix"]


def _clocked_run(monkeypatch, tmp_path, methods, budget_minutes, gain, race_requests=6, sizes_seen=None,
                 plugin=None):
    """A serving autotune on a fake clock (every server start 50 s, every pass 40 s), the race faked with
    tokens/s = level x gain(k, level) at draft length k; (summary, raced names in order, race.json)."""
    levels = [1, 4, 16]
    profiles, rec = _faked_inputs(monkeypatch, tmp_path, levels, methods)

    class Clock:
        now = 1000.0

        def time(self):
            return self.now

        perf_counter = time

    clock = Clock()
    monkeypatch.setattr(sv, "time", clock)
    monkeypatch.setattr(sr, "time", clock)
    raced = []

    def fake_race(engine, c, race, lvls=None, into=None):
        results, lvls = race.results, list(lvls or race.levels)
        sizes = {lv: len(race.traffic.requests[(lv, 0)]) for lv in lvls}
        raced.append(c.name)
        if sizes_seen is not None:
            sizes_seen[c.name] = sizes
        timing = {"start_s": [], "level_s": {}}
        for lv in lvls:
            if lv == lvls[0] or sr.server_per_pass(c):
                clock.now += 50.0
                timing["start_s"].append(50.0)
            n = sizes[lv]
            clock.now += 40.0 * n / 6
            timing["level_s"][lv] = [40.0 * n / 6]
            k = 0 if c.speculative is None else sd.k_by_level(c.speculative, [lv])[lv]
            tps = lv * (gain(k, lv) if k else 1.0)
            recs = [RequestRecord(i, 0.0, latency_s=(1 + 0.1 * i) * lv / tps, output_tokens=8, token_ids=list(range(8)))
                    for i in range(n)]
            results.setdefault(c.name, {})[lv] = [{"result": LoadResult(lv, 48 / tps, recs),
                                                   "counters": SpecDecodeCounters()}]
        return timing

    monkeypatch.setattr(sr, "race_contender", fake_race)
    s = sv.ServingSettings(concurrency=tuple(levels), methods=tuple(methods), out=str(tmp_path / "run"),
                           quiet=True, race_requests=race_requests, accept_requests=2, budget_minutes=budget_minutes,
                           plugin=plugin)
    summary = autotune(s)
    return summary, raced, json.loads((tmp_path / "run" / "race.json").read_text())


def test_the_budget_races_the_planned_schedule_first_and_skips_what_it_cannot_fit(monkeypatch, tmp_path):
    """--budget bounds the serving run: after plain's race every contender is priced from it and races
    only if it fits the time left, less plain's time kept for confirming the decision and writing; the
    planned schedule races first, and what is skipped is said in race.json, the summary and the report."""
    # plain 170 s; kept for plain's closing server, confirming and writing 355 s; room for two more
    # contenders of about 170 s (the planned and the fixed length), not for the stock settings after them
    budget = (170 + 2 * 175 + 355) / 60
    summary, raced, race = _clocked_run(monkeypatch, tmp_path, ("ngram", "suffix"), budget, lambda k, lv: 1.2)
    names = [c["name"] for c in race["contenders"]]
    planned = [n for n in names if n.startswith("planned")]
    assert raced[0] == sr.PLAIN and raced[1] == planned[0] and raced[-1] == sr.CLOSING, raced
    assert len(raced) == 4 and set(race["skipped"]) == {"ngram defaults", "suffix defaults"}  # the stock last
    assert "suffix defaults" in race["skipped"] and "suffix defaults" not in raced
    assert race["skipped"]["suffix defaults"].startswith("not raced: predicted 270 s")  # a server per level
    assert set(race["skipped"]) | set(raced) >= set(names) - {sr.DECISION}
    assert summary["skipped"] == race["skipped"] and summary["budget"]["minutes"] == pytest.approx(budget)
    assert set(summary["budget"]["seconds_by_contender"]) == set(raced)
    report = (tmp_path / "run" / "report.md").read_text()
    assert "- suffix defaults: not raced" in report and "min of a" in report
    # both raced contenders are ahead of plain at every level (* on each), one wins each level (bold)
    cells = [c.strip() for line in report.splitlines() if line.startswith(("| planned", "| fixed"))
             for c in line.split("|")[2:-1] if "x)" in c]  # the tokens/s table's, not the time per token's
    assert len(cells) == 6 and all(c.endswith("x)*") or c.endswith("x)***") for c in cells), cells
    assert sum(c.startswith("**") for c in cells) == 3, cells
    assert "Plain's drift over the race (the second server's tokens/s over the first's): 1: 1.00, 4: 1.00, 16: 1.00" \
        in report
    assert (tmp_path / "run" / "chosen.json").is_file()


@pytest.mark.parametrize("plugin", [False, True])
def test_a_confirmation_the_budget_cannot_fit_never_writes_a_level_measured_behind_plain(monkeypatch, tmp_path, plugin):
    """Speculation loses at 16, so the decision switches it off there, a config no contender ran, and no time is
    left to race it. The losing setting is never written: without the plugin (K = 0 there would not be plain)
    the decision is a raced config behind plain nowhere, else plain; with it, the switched-off schedule as
    written is measured-safe (K = 0 is vLLM's plain path at 16, the winner's own rows elsewhere)."""
    _, raced, race = _clocked_run(monkeypatch, tmp_path, ("ngram",), (170 + 175 + 30) / 60,
                                  lambda k, lv: 1.2 if lv < 16 else 0.8, plugin=plugin)
    assert sr.DECISION not in raced and raced[-1] == sr.CLOSING and len(raced) == 3, raced
    chosen = json.loads((tmp_path / "run" / "chosen.json").read_text())
    why = chosen["decision"]
    # with the plugin the confirmation races where the decision drafts only (1 and 4): its K = 0 is plain's path
    assert why["confirm"].startswith(f"not raced: predicted {130 if plugin else 170} s") and '[16, 256, 0]' in \
        why["confirm"]
    if plugin:
        assert why["winner"] == raced[1] and chosen["plugin"] is True
        assert chosen["speculative_config"]["num_speculative_tokens_per_batch_size"][-1] == [16, 256, 0]
        assert why["vs_plain_by_level"]["16"] == 1.0 and why["vs_plain_by_level"]["1"] == pytest.approx(1.2)
    else:
        assert why["winner"] == sr.PLAIN and chosen["speculative_config"] is None and chosen["plugin"] is False
        assert why["measured_decision"]["levels_behind_plain"] == [16]
    assert "Confirmation: not raced" in (tmp_path / "run" / "report.md").read_text()


def test_a_suffix_decision_with_the_plugin_is_priced_on_one_server_and_confirmed(monkeypatch, tmp_path):
    """The sampled main job of 2026-12-03 priced suffix's switched-off schedule at a server per pass (251 s) though
    with the plugin it races on one (about plain's 151 s), found no room for it in the 177 s left, and wrote it
    unconfirmed. Priced as it races, the confirmation fits: one server's start and plain's passes."""
    # plain, planned suffix, then plain's closing and a confirmation at 1 and 4 (130 s), not a stock setting (170 s)
    budget = (170 + 175 + 340) / 60
    _, raced, _ = _clocked_run(monkeypatch, tmp_path, ("suffix",), budget, lambda k, lv: 1.2 if lv < 16 else 0.8,
                               plugin=True)
    assert raced[:2] == [sr.PLAIN, "planned suffix"] and raced[-1] == sr.DECISION, raced
    chosen = json.loads((tmp_path / "run" / "chosen.json").read_text())
    assert chosen["plugin"] is True and "confirm" not in chosen["decision"]
    assert chosen["speculative_config"]["num_speculative_tokens_per_batch_size"][-1] == [16, 256, 0]
    assert chosen["decision"]["measured_as"] == sr.DECISION


def test_when_the_best_proposer_runs_one_length_the_best_switchable_schedule_races_too(tmp_path):
    """Replayed on the committed fresh run: the planner predicted suffix (one length in vLLM) ahead and
    raced only its fixed K = 1, which measured 0.55x plain at 16 requests. The best proposer that a
    schedule can switch off by batch size now races its planned schedule beside it."""
    from planner.profile import load_batch_profiles

    run = ROOT / "reports" / "main-job-vllm-cpu-smollm2-135m-fresh"
    levels = [1, 2, 4, 8, 16]
    profiles = load_batch_profiles(str(run / "profile.json"))
    records = {m: json.loads((run / f"accept-{m}.json").read_text()) for m in ("ngram", "suffix", "draft_model")}
    overhead = {int(k): v for k, v in json.loads((run / "plans.json").read_text())["server_overhead_s"].items()}
    s = sv.ServingSettings()
    cs = sp.planned_contenders(records, profiles, levels, s, {"draft_model": "draft-dir"}, overhead, tmp_path,
                               lambda line: None)
    by_name = {c.name: c for c in cs}
    plans = json.loads((tmp_path / "plans.json").read_text())
    assert plans["chosen_method"] == "suffix" and plans["planned_methods"] == ["suffix", "ngram"]
    # K = 1 when every suffix step was priced as 8 drafts; it sent 1.5-2 (drafted_per_step), so longer now
    assert f"fixed suffix K={plans['plans']['suffix']['best_fixed']}" in by_name
    ngram = by_name["planned ngram"]
    expect = planning.schedule_ranges({int(k): v for k, v in plans["plans"]["ngram"]["per_level"].items()}, levels)
    assert ngram.speculative["num_speculative_tokens_per_batch_size"] == expect and ngram.predicted
    # a schedulable best proposer races alone, as before
    only = sp.planned_contenders({"ngram": records["ngram"]}, profiles, levels, s, {}, overhead, tmp_path,
                                  lambda line: None)
    assert [c.name for c in only if c.name.startswith("planned")] == ["planned ngram"]


def test_after_the_confirmation_the_best_measured_config_behind_plain_nowhere_is_deployed():
    """Replayed on the committed --budget 40 run: fixed ngram K = 8 won three levels, was switched off at 16
    and confirmed at 1.16x over the levels; the planned schedule, behind plain nowhere, measured 1.18x as
    raced. The decision is the better measured one; a config behind plain at a level is never picked."""
    run = ROOT / "reports" / "main-job-vllm-cpu-smollm2-135m-budget40"
    race = json.loads((run / "race.json").read_text())
    levels = [lv["level"] for lv in race["levels"]]
    cs = [sr.Contender(c["name"], c["config"]) for c in race["contenders"]]
    chosen, why = sd.decision([c for c in cs if c.name != sr.DECISION], race["levels"], levels)
    assert why["winner"] == "fixed ngram K=8" and why["levels_behind_plain"] == [16]
    best, scores = sd.best_measured(cs, race["levels"], levels)
    assert best.name == "planned ngram"
    assert scores["planned ngram"] == pytest.approx(1.18, abs=0.005)
    assert scores[sr.DECISION] == pytest.approx(1.16, abs=0.005)
    assert set(scores) == {"planned ngram", sr.DECISION}  # the rest were behind plain at 8 or 16 requests
    why = sd.measured_why(best, race["levels"], levels, scores, why)
    assert why["levels_behind_plain"] == [] and why["draft_length_by_level"] == {1: 8, 2: 8, 4: 8, 8: 1, 16: 2}
    assert why["decided_first"]["winner"] == "fixed ngram K=8"
    # behind plain at one level (K = 0 by schedule measured 0.95x at 16): out, whatever its mean
    lost = [dict(lv, contenders=dict(lv["contenders"])) for lv in race["levels"]]
    lost[-1]["contenders"]["planned ngram"] = _row(0.95, lo=0.9) | {"paired": {"lo": 0.9, "mean": 0.95, "hi": 0.97}}
    assert sd.best_measured(cs, lost, levels)[0].name == sr.DECISION
    assert sd.best_measured([cs[0]], race["levels"], levels) is None  # plain is not a candidate


def test_the_autotune_deploys_the_best_measured_config_not_the_one_that_won_most_levels(monkeypatch, tmp_path):
    """Every ngram contender wins the low levels by a little (1.3x) and loses at 16 (0.8x); suffix is ahead
    everywhere by a steady 1.25x. The decision rule takes the ngram config that won the most levels and
    confirms it switched off at 16: 1.3 / 1.3 / 1.0x, a geometric mean of 1.19x, below suffix's as
    raced, behind plain nowhere: suffix is written."""
    summary, raced, race = _clocked_run(monkeypatch, tmp_path, ("ngram",), 60,
                                        lambda k, lv: 1.25 if k > 8 else (1.3 if lv < 16 else 0.8))
    chosen = json.loads((tmp_path / "run" / "chosen.json").read_text())
    why = chosen["decision"]
    assert raced[-1] == sr.DECISION and "ngram" in why["decided_first"]["winner"]
    assert why["decided_first"]["vs_plain_by_level"]["16"] == pytest.approx(1.0)
    assert why["winner"] == "suffix defaults" and why["levels_behind_plain"] == []
    assert why["geomean_vs_plain"] == pytest.approx(1.25, rel=1e-6)
    winner = next(c for c in race["contenders"] if c["name"] == why["winner"])
    assert chosen["speculative_config"] == winner["config"] and "chosen_by" in why


def test_race_sizes_cut_the_longest_levels_first_and_alike_for_every_contender():
    """Two races (plain's and the first contender's) of 50 s fixed plus the levels' passes of 16 requests
    (160 / 80 / 40 s at 1 / 2 / 4): cut at one request first (10 s a request there), in even counts,
    never below 8 requests or the level; 16 requests at 16 cannot be cut."""
    pass_s, levels = {1: 160.0, 2: 80.0, 4: 40.0}, [1, 2, 4]
    assert sr.race_sizes(pass_s, 50.0, 16, levels, 1000.0, 2) == {1: 16, 2: 16, 4: 16}
    assert sr.race_sizes(pass_s, 50.0, 16, levels, 500.0, 2) == {1: 8, 2: 16, 4: 16}  # 2 x (50 + 80 + 80 + 40)
    assert sr.race_sizes(pass_s, 50.0, 16, levels, 560.0, 2) == {1: 10, 2: 16, 4: 16}  # 11 would fit: even
    assert sr.race_sizes(pass_s, 50.0, 16, levels, 440.0, 2) == {1: 8, 2: 10, 4: 16}
    assert sr.race_sizes(pass_s, 50.0, 16, levels, 420.0, 2) == {1: 8, 2: 8, 4: 16}
    assert sr.race_sizes(pass_s, 50.0, 16, levels, 10.0, 2) == {1: 8, 2: 8, 4: 8}  # as far as it goes
    assert sr.race_sizes(pass_s, 50.0, 6, levels, 10.0, 2) == {1: 6, 2: 6, 4: 6}  # too few to cut
    assert sr.race_sizes({3: 60.0, 16: 10.0}, 0.0, 16, [3, 16], 1.0, 1) == {3: 12, 16: 16}  # a multiple of 3, even
    # time no cut shortens (a learner's further server starts) comes off what the cuts share
    assert sr.race_sizes(pass_s, 50.0, 16, levels, 760.0, 2, extra_s=100.0) == {1: 16, 2: 16, 4: 16}
    assert sr.race_sizes(pass_s, 50.0, 16, levels, 660.0, 2, extra_s=100.0) == {1: 10, 2: 16, 4: 16}


def test_levels_only_plains_first_server_races_count_once_in_the_race_sizes():
    """With the plugin no contender races a level where no plan drafts (its K = 0 is vLLM's plain path) and plain's
    closing server races only where one did: such a level's pass counts once, not once per race. Two races of
    50 s fixed: 2 x (50 + 160 + 80) + 40 = 620 s, where counting level 4 twice (660 s) cut one request."""
    pass_s, levels = {1: 160.0, 2: 80.0, 4: 40.0}, [1, 2, 4]
    assert sr.race_sizes(pass_s, 50.0, 16, levels, 620.0, 2) == {1: 14, 2: 16, 4: 16}
    assert sr.race_sizes(pass_s, 50.0, 16, levels, 620.0, 2, once=[4]) == {1: 16, 2: 16, 4: 16}
    assert sr.race_sizes(pass_s, 50.0, 16, levels, 600.0, 2, once=[4]) == {1: 14, 2: 16, 4: 16}
    # which level is cut first weighs its requests by the races that run them: 2 x 10 s at 1 before 12.5 s at 2
    assert sr.race_sizes({1: 160.0, 2: 200.0}, 0.0, 16, [1, 2], 450.0, 2, once=[2]) == {1: 12, 2: 16}
    assert sr.race_sizes({1: 160.0, 2: 200.0}, 0.0, 16, [1, 2], 450.0, 2) == {1: 12, 2: 8}


def test_with_the_plugin_the_race_is_sized_for_the_levels_a_plan_drafts():
    """Before plain's race the plans priced on the profile alone say where some proposer drafts: with the
    plugin the other races run only there, so the same time keeps more requests at one request; where no
    plan drafts anywhere every race may run every level (the planner's fixed length and the stock settings do)."""
    levels = [1, 4, 16]
    profiles = _profiles(levels, per_token_s=0.016)
    low = {"accuracy": [[x] for x in [0.5, 0.3, 0.2, 0.1, 0.05, 0.0, 0.0, 0.0]], "guesser": {"draft_passes": "one"},
           "vllm": {"server_start_s": 30.0}}
    s = sv.ServingSettings(concurrency=tuple(levels), methods=("ngram",))
    drafting = sp.drafting_levels({"ngram": low}, profiles, levels, s)
    assert 1 in drafting and 16 not in drafting, drafting
    plain_sizes = sp.race_size_for_budget(profiles, {"ngram": low}, s, levels, 650.0, 16)
    plugin_sizes = sp.race_size_for_budget(profiles, {"ngram": low}, s, levels, 650.0, 16, plugin=True)
    assert plain_sizes[1] < plugin_sizes[1] and all(plugin_sizes[lv] >= plain_sizes[lv] for lv in levels)
    never = {**low, "accuracy": [[0.0]] * 8}
    assert sp.drafting_levels({"ngram": never}, profiles, levels, s) == set()
    assert sp.race_size_for_budget(profiles, {"ngram": never}, s, levels, 500.0, 16, plugin=True) == \
        sp.race_size_for_budget(profiles, {"ngram": never}, s, levels, 500.0, 16)


def test_the_race_resolves_the_contenders_that_could_overturn_the_decision_winner_first(monkeypatch):
    """suffix is ahead at 2 and decides (K = 0 at 1, where it is unresolved at 1.05x); ngram raced 1.12x at 1,
    unresolved: more passes could make it the better decision there, so it is resolved too; eagle3, slower
    than what the decision writes at every level, is not. A pass that does not fit both leaves the last out."""
    from profiler.workload import Request

    gains = {"planned suffix": {1: 1.05, 2: 1.3}, "planned ngram": {1: 1.12, 2: 1.04}, "planned eagle3": {1: 0.99, 2: 1.1}}
    levels, budget, calls = [1, 2], [50.0], []

    def fake(engine, c, race, lvls=None, into=None):
        calls.append((c.name, list(lvls or race.levels)))
        for lv in lvls or race.levels:
            tps = lv * (gains[c.name][lv] if c.speculative else 1.0)
            recs = [RequestRecord(i, 0.0, latency_s=(1 + 0.1 * i) * lv / tps, output_tokens=8, token_ids=list(range(8)))
                    for i in range(8)]
            race.results.setdefault(c.name, {})[lv] = [{"result": LoadResult(lv, 64 / tps, recs),
                                                        "counters": SpecDecodeCounters(), "server": 1}]
        if c.name == sr.CLOSING:  # plain's server closes a resolving pass: it spends the budget
            budget[0] = 0.0
        return {"start_s": [], "level_s": {}}

    monkeypatch.setattr(sr, "race_contender", fake)
    reqs = [Request([{"role": "user", "content": f"q{i}"}], 8) for i in range(8)]
    race = sr.Race(sr.same_requests(reqs, reqs[:1], levels, 1, None, 60.0), levels, lambda line: None)
    raced = [sr.Contender(n, {"method": n.split()[1], "num_speculative_tokens": 4}, plugin=True) for n in gains]
    sr.race_all(None, [sr.Contender(sr.PLAIN, None), *raced], race)
    _, why = sd.decision(raced, race.rows(), levels, plugin=True)
    assert why["winner"] == "planned suffix" and why["draft_length_by_level"] == {1: 0, 2: 4}
    todo = sd.to_resolve(raced, why, race.rows(), levels)
    assert [c.name for c in todo] == ["planned suffix", "planned ngram"]
    # each pass: plain's server and each candidate's, 10 s to start and 10 s a level: 40 s for suffix alone
    race.timings[sr.PLAIN] = {"start_s": [10.0], "level_s": {1: [10.0], 2: [10.0]}, "wall_s": 40.0}
    del calls[:]
    left = sr.resolve(None, race, todo, lambda: budget[0])
    assert calls == [("planned suffix", [1]), (sr.CLOSING, [1])], calls
    assert left == {"planned suffix": [1], "planned ngram": [1, 2]}
    # no contender decided: every one unresolved above plain somewhere is resolved, none first
    assert [c.name for c in sd.to_resolve(raced, {"winner": sr.PLAIN}, race.rows(), levels)] == \
        ["planned suffix", "planned ngram", "planned eagle3"]


def test_a_measured_proposer_that_learns_prices_a_server_per_pass_into_the_race_sizes():
    """suffix races on a fresh server per level and round: sized as one server, a 15-minute run took 16.1.
    With suffix measured, the first contender's and the confirmation's further starts (2 x 4 x 40 s at five
    levels) are priced, so the same time left races fewer requests; ngram alone keeps the old sizes."""
    levels = [1, 2, 4, 8, 16]
    profiles = _profiles(levels, fixed_s=0.05, per_token_s=0.002)
    s = sv.ServingSettings()

    def rec(method):  # drafts at every level: with the plugin no level is raced by plain's first server alone
        return {"guesser": {"method": method, "draft_passes": "one"}, "vllm": {"server_start_s": 40.0},
                "accuracy": [[0.9]] * 8}

    lookup = sp.race_size_for_budget(profiles, {"ngram": rec("ngram")}, s, levels, 700.0, 16)
    learner = sp.race_size_for_budget(profiles, {"ngram": rec("ngram"), "suffix": rec("suffix")}, s, levels, 700.0, 16)
    assert sum(learner.values()) < sum(lookup.values())
    assert sp.race_size_for_budget(profiles, {"ngram": rec("ngram")}, s, levels, 700.0 + 320.0, 16) == \
        sp.race_size_for_budget(profiles, {"suffix": rec("suffix")}, s, levels, 700.0 + 2 * 4 * 40.0 + 320.0, 16)
    # with the plugin, suffix races on one server (its reset makes it forget): sized as ngram
    assert sp.race_size_for_budget(profiles, {"ngram": rec("ngram"), "suffix": rec("suffix")}, s, levels, 700.0, 16,
                                   plugin=True) == lookup


def test_a_short_budget_races_every_contender_on_the_same_first_requests(monkeypatch, tmp_path):
    """The budget left after acceptance cannot hold plain's race and the planned schedule's at 16 requests
    a level: both race the first 8 at one request, the same cut, and the report says so."""
    seen = {}
    summary, raced, race = _clocked_run(monkeypatch, tmp_path, ("ngram",), 4.5, lambda k, lv: 1.2,
                                        race_requests=16, sizes_seen=seen)
    sizes = {int(k): v for k, v in race["requests_by_level"].items()}
    assert sizes[1] < 16 and sizes[16] == 16 and sizes[1] % 2 == 0, sizes
    assert seen[sr.PLAIN] == sizes and seen[raced[1]] == sizes
    assert summary["race_requests"] == {"requests": 16, "by_level": sizes}
    assert "Cut to fit the budget: every contender raced the first" in (tmp_path / "run" / "report.md").read_text()
    assert all(len(lv["contenders"]) >= 2 for lv in race["levels"])


# ---------------------------------------------------------------------------------------------- served levels

def _waves(n: int, b: int, request_s: float, steps: int, step_s: float) -> float:
    """Wall seconds of n requests at concurrency b, each request_s plus `steps` decoding steps of step_s:
    simulated slot by slot (a request starts when a slot frees), independent of the closed form."""
    free = [0.0] * b
    for _ in range(n):
        t = min(free)
        free[free.index(t)] = t + request_s + steps * step_s
    return max(free)


@pytest.mark.parametrize("b, request_s", [(1, 0.3), (4, 0.6), (16, 2.3)])
def test_plains_pass_splits_a_request_into_its_decoding_steps_and_the_rest(b, request_s):
    """A request's time is its decoding steps plus the rest (its prefill, its first token, its share of the
    ramp and tail), and speculation shortens only the steps. served_level recovers both parts from plain's
    pass; predicted_tokens_per_s is then exact against a slot-by-slot simulation of the same server with a
    proposer that accepts exactly one draft a step (tau = 2), and k = 0 is plain's measured tokens/s."""
    n, out_tokens, step = 16, 30, 0.2  # the served step above the profiled plain one (0.104-0.164), as served
    profile = _profiles([b])[b]
    tps = n * (1 + out_tokens) / _waves(n, b, request_s, out_tokens, step)
    v = planning.served_level(b, tps, n, n * (1 + out_tokens), step)
    assert v.decode_step_s == pytest.approx(step) and v.request_s == pytest.approx(request_s) and n % b == 0
    assert v.decode_tokens == out_tokens
    prefix = np.array([1.0] + [0.0] * 7)  # the first draft always accepted, the rest never: 2 tokens a step
    assert planning.predicted_tokens_per_s(prefix, profile, b, 0, served=v) == pytest.approx(tps)
    for k in (1, 4):  # every step drafts and scores 1 + k tokens a request
        spec_step = step + profile.latency(1 + k) - profile.latency(1)
        sim = n * (1 + out_tokens) / _waves(n, b, request_s, out_tokens // 2, spec_step)
        assert planning.predicted_tokens_per_s(prefix, profile, b, k, served=v) == pytest.approx(sim)
        tokens, priced = planning.priced_step(prefix, profile, b, k, served=v)
        assert (tokens, priced) == pytest.approx((2.0, spec_step))
    # the per-step view (the same wall time charged to every step) credits speculation with shortening the
    # rest too: here it predicts more than the served split (so whenever a draft costs less than (tau - 1) request_s)
    per_step = planning.server_overhead({b: profile}, {b: tps}, [b])[b]
    for k in (1, 4):
        assert planning.predicted_tokens_per_s(prefix, profile, b, k, overhead_s=per_step) > \
            planning.predicted_tokens_per_s(prefix, profile, b, k, served=v)
    assert planning.served_level(b, tps, n, n, step) is None  # one token each: nothing decoded
    assert planning.served_level(b, tps, n, n * (1 + out_tokens), None) is None  # no chunk gaps seen


def test_the_autotune_plans_on_plains_served_split_and_reports_what_each_prediction_rested_on(monkeypatch, tmp_path):
    """Where plain's streams are timed, phase 3 splits its pass into the served step and each request's
    time outside it, and every prediction is priced on that split (plan_method with served); the report
    shows plain's split and, per planned contender and level, the tokens per step and the step it was
    priced on beside the race's own."""
    levels = [1, 4]
    profiles, rec = _faked_inputs(monkeypatch, tmp_path, levels, ("ngram",))
    step = {1: 0.11, 4: 0.13}  # plain's served step; 0.5 s more per request outside its 7 decoding steps

    def fake_race(engine, c, race, lvls=None, into=None):
        results, lvls = race.results, list(lvls or race.levels)
        sizes = {lv: len(race.traffic.requests[(lv, 0)]) for lv in lvls}
        for lv in lvls:
            k = 0 if c.speculative is None else sd.k_by_level(c.speculative, [lv])[lv]
            gap = step[lv] if k == 0 else step[lv] * 1.5  # a speculative step: fewer gaps, each longer
            chunks = 7 if k == 0 else 4
            times = [0.5 + gap * i for i in range(chunks + 1)]
            recs = [RequestRecord(i, 0.0, ttft_s=0.5, token_times_s=times, latency_s=times[-1], output_tokens=8,
                                  token_ids=list(range(8))) for i in range(8)]
            counters = SpecDecodeCounters(drafts=8 * chunks, draft_tokens=8 * chunks * max(k, 1),
                                          accepted_tokens=8 * (7 - chunks)) if k else SpecDecodeCounters()
            results.setdefault(c.name, {})[lv] = [{"result": LoadResult(lv, 8 / lv * times[-1], recs),
                                                   "counters": counters}]

    monkeypatch.setattr(sr, "race_contender", fake_race)
    s = sv.ServingSettings(concurrency=tuple(levels), methods=("ngram",), out=str(tmp_path / "run"), quiet=True,
                           race_requests=8, accept_requests=2)
    summary = autotune(s)
    served = {lv: planning.ServedLevel(**v) for lv, v in summary["served"].items()}
    assert {lv: v.decode_step_s for lv, v in served.items()} == pytest.approx(step)
    assert {lv: v.request_s for lv, v in served.items()} == pytest.approx({1: 0.5, 4: 0.5})
    expect = planning.plan_method("ngram", rec, profiles, levels, max(s.draft_lengths), {}, served=served)
    race = json.loads((tmp_path / "run" / "race.json").read_text())
    fixed = next(c for c in race["contenders"] if c["name"].startswith("fixed"))
    assert {int(k): v for k, v in fixed["predicted_tokens_per_s"].items()} == pytest.approx(expect["fixed_predicted"])
    parts = summary["prediction_parts"][fixed["name"]]
    for lv in levels:
        (tp, tm), (sp, sm) = parts[lv]["tokens_per_step"], parts[lv]["step_s"]
        assert tp == pytest.approx(expect["fixed_priced"][lv]["tokens_per_step"]) and tm == pytest.approx(7 / 4)
        assert sp == pytest.approx(expect["fixed_priced"][lv]["step_s"]) and sm == pytest.approx(step[lv] * 1.5)
    report = (tmp_path / "run" / "report.md").read_text()
    assert "vLLM plain's pass, split (ms): the served step / each request's time outside" in report
    assert "1: 110 / 500, 4: 130 / 500" in report and "What each prediction rested on" in report


def test_a_drafters_pass_is_priced_from_its_served_step_beside_plains():
    """A drafter's acceptance load (run alone) prices its draft pass: its served step less plain's at the
    same concurrency (between two levels: interpolated) less the profile's price for scoring its k drafts,
    per pass; without timed streams or plain's split, the load's wall time over its steps, as before."""
    levels = [1, 2, 8]
    profiles = _profiles(levels)
    served = {b: planning.ServedLevel(decode_step_s=0.1 + 0.01 * b, request_s=0.3, decode_tokens=31) for b in levels}
    k, per_pass = 4, 0.012
    plain_at_4 = 0.1 + 0.01 * 4  # linear in b here, so the interpolation is exact
    scoring = profiles[2].latency(1 + k) - profiles[2].latency(1)  # the profiled batch nearest 4
    spec = plain_at_4 + scoring + k * per_pass
    rec = {"vllm": {"concurrency": 4, "draft_length": k, "step_p50_s": spec, "steps": 100, "load_wall_s": 60.0,
                    "requests": 8}}
    got = planning.draft_costs(rec, profiles, levels, served)
    assert got == pytest.approx({b: per_pass for b in levels})
    wall = planning.draft_costs(rec, profiles, levels)  # no plain split: the wall time, which also holds the
    assert wall[1] == pytest.approx((60.0 * 4 / 100 - profiles[2].latency(1 + k)) / k)  # per-request time
    assert wall[1] > got[1]
    # a sampled record counts more passes than it timed: the wall time is over the timed pass's own steps
    counted = {"vllm": dict(rec["vllm"], steps=250, timed_steps=100)}
    assert planning.draft_costs(counted, profiles, levels) == pytest.approx(wall)
    cheap = dict(rec["vllm"], step_p50_s=plain_at_4)  # faster than plain plus scoring: never a negative pass
    assert planning.draft_costs({"vllm": cheap}, profiles, levels, served) == {b: 0.0 for b in levels}


def test_a_profiled_plain_step_above_plains_served_one_does_not_price_drafts_at_nothing():
    """vLLM's plain engine and its speculative one are profiled one after the other; when the plain one ran
    in a slow spell its step is above the server's own (which carries the engine's and more), and the
    profile's L(b, 1 + k) - L(b, 1) prices short drafts at nothing. Plain's served step stands in there."""
    ns = np.arange(1, 10)
    healthy = LatencyProfile(ns, 0.05 + 0.004 * ns, {"file": "fake"})
    slow_plain = LatencyProfile(ns, np.maximum(0.05 + 0.004 * ns, 0.07), {"file": "fake"})  # L(1) 0.07, flat to K=4
    assert slow_plain.latency(1) == pytest.approx(slow_plain.latency(5))
    fast_served = planning.ServedLevel(decode_step_s=0.055, request_s=0.3, decode_tokens=31)
    slow_served = planning.ServedLevel(decode_step_s=0.08, request_s=0.3, decode_tokens=31)
    # the served step below the profiled plain one: the price is measured from the served step
    assert planning.scoring_price(slow_plain, 4, 0.055) == pytest.approx(0.07 - 0.055)
    assert planning.scoring_price(slow_plain, 4) == 0.0  # the profile alone: free
    # a served step above the profiled one (the usual case) changes nothing
    assert planning.scoring_price(healthy, 4, 0.08) == pytest.approx(0.004 * 4)
    assert planning.scoring_price(healthy, 4, None) == pytest.approx(0.004 * 4)
    prefix = np.array([0.3, 0.2, 0.1, 0.05])
    _, step = planning.priced_step(prefix, slow_plain, 1, 4, served=fast_served)
    assert step == pytest.approx(0.055 + (0.07 - 0.055))
    _, step = planning.priced_step(prefix, healthy, 1, 4, served=slow_served)
    assert step == pytest.approx(0.08 + 0.004 * 4)


def test_the_vllm_main_jobs_builtin_traffic_mixes_chats_and_input_repeating_requests_alike_in_both_halves():
    """The default requests are the serving benchmark's two kinds, half each, never its texts: held-out
    questions' first turns (the benchmark's chats are first turns) and requests to rewrite, summarise, correct
    or list a validation document the benchmark leaves out, alternating two by two, so acceptance and race ask
    the same tasks, the same categories, and any prefix a budget cut races holds both kinds."""
    import argparse

    from training.splits import REQUESTS, bench_prompts
    from workflows.cli import cmd_autotune
    from workflows.cli.inputs import DEFAULT_QUESTIONS

    p = argparse.ArgumentParser()
    cmd_autotune.add_arguments(p)
    assert p.parse_args([]).accept_prompts is None  # each engine's own default
    category = {}
    for line in Path(DEFAULT_QUESTIONS).read_text().splitlines():
        q = json.loads(line)
        category[q["turns"][0].strip()] = q["category"]
    task = {r.split("{}")[0]: i for i, r in enumerate(REQUESTS)}

    def kinds(reqs):
        return ["chat" if r.messages[0]["content"] in category else
                "task %d" % task[r.messages[0]["content"].split("\n\n")[0] + "\n\n"] for r in reqs]

    s = sv.ServingSettings()
    accept, race = sv.requests(s)
    assert len(accept) == s.accept_requests == 16 and len(race) == 16
    assert kinds(accept) == kinds(race)  # the same kinds in the same places
    assert kinds(race)[:8] == ["chat", "chat", "task 0", "task 1", "chat", "chat", "task 2", "task 3"]
    chats = [category[r.messages[0]["content"]] for r in race if r.messages[0]["content"] in category]
    # one question of each category, single turns; the spread puts both kinds of question text first
    assert chats == ["writing", "coding", "roleplay", "extraction", "reasoning", "stem", "math", "humanities"]
    assert all(len(r.messages) == 1 for r in accept + race)
    assert sorted(chats) == sorted(category[r.messages[0]["content"]] for r in accept
                                   if r.messages[0]["content"] in category)
    texts = {r.messages[0]["content"] for r in accept} | {r.messages[0]["content"] for r in race}
    assert len(texts) == 32  # every request distinct
    benchmark = {p.turns[0] for p in bench_prompts("repeat", 144)}
    assert not texts & benchmark
    assert sv.spread(list(range(6))) == [0, 1, 4, 5, 2, 3] and sv.spread(list(range(8))) == [0, 1, 4, 5, 2, 3, 6, 7]
    assert sv.mixed([1, 2, 3, 4], ["a", "b"]) == [1, 2, "a", "b", 3, 4]
    with pytest.raises(UserError, match="--accept-prompts 18: the built-in traffic holds 16 requests a half"):
        sv.requests(sv.ServingSettings(accept_requests=18))


# ---------------------------------------------------------------------------------------------- the plugin, resolving


def test_with_the_plugin_k0_is_priced_as_plain_and_suffix_takes_a_schedule(tmp_path):
    """With the plugin a schedule's K = 0 is vLLM's plain path: planned at plain's tokens/s (off_ratio 1), so a
    draft predicted a little below plain is switched off instead of kept, and suffix, which asserts one length
    without the plugin, is planned and raced as a per-batch-size schedule (served with the plugin on)."""
    levels = [1, 16]
    profiles = _profiles(levels, per_token_s=0.01)
    rec = {"accuracy": [[0.6]] * 8, "guesser": {"draft_passes": "one"}}
    without = planning.plan_method("ngram", rec, profiles, levels, 8, {}, off_ratio=0.92)
    with_plugin = planning.plan_method("ngram", rec, profiles, levels, 8, {}, off_ratio=1.0)
    assert with_plugin["per_level"][16] == 0 and with_plugin["predicted"][16] == pytest.approx(
        with_plugin["plain_predicted"][16])
    assert without["per_level"][16] >= with_plugin["per_level"][16]
    assert not planning.schedulable("suffix") and planning.schedulable("suffix", plugin=True)
    s = sv.ServingSettings(concurrency=tuple(levels))
    cs = sp.planned_contenders({"suffix": rec}, profiles, levels, s, {}, {}, tmp_path, lambda line: None, plugin=True)
    planned = next(c for c in cs if c.name == "planned suffix")
    assert planned.plugin and planned.speculative["num_speculative_tokens_per_batch_size"][-1][2] == 0
    off = sp.planned_contenders({"suffix": rec}, profiles, levels, s, {}, {}, tmp_path, lambda line: None)
    assert not any(c.name == "planned suffix" for c in off)  # one length without it: only the fixed one races
    assert json.loads((tmp_path / "plans.json").read_text())["plugin"] is False


def test_sampled_every_speculative_contender_runs_with_the_plugin(tmp_path):
    """vLLM 0.32's CPU build verifies sampled drafts right only with the plugin, so sampled, the stock settings,
    the fixed length and a planned schedule without K = 0 are all served with it; greedy, only what needs it;
    without the plugin installed, none."""
    levels = [1, 16]
    profiles = _profiles(levels, per_token_s=0.01)
    rec = {"accuracy": [[0.9]] * 8, "guesser": {"draft_passes": "one"}}

    def contenders(temperature: float, plugin: bool) -> dict[str, bool]:
        s = sv.ServingSettings(concurrency=tuple(levels), temperature=temperature)
        cs = sp.planned_contenders({"ngram": rec}, profiles, levels, s, {}, {}, tmp_path, lambda line: None,
                                   plugin=plugin)
        return {c.name: c.plugin for c in cs if c.speculative}

    sampled = contenders(0.7, True)
    assert len(sampled) >= 3 and all(sampled.values()), sampled
    greedy = contenders(0.0, True)
    assert not any(on for name, on in greedy.items() if not name.startswith("planned")), greedy
    assert not any(contenders(0.7, False).values())


def test_with_the_plugin_every_level_not_measured_ahead_is_switched_off():
    """K = 0 costs nothing with the plugin, so a tie is switched off as a loss is (measured-safe), and a one-length
    proposer (suffix) that loses somewhere is a candidate: its schedule switches it off there."""
    levels = [1, 4, 16]
    raced = {"method": "ngram", "num_speculative_tokens": 4}
    cs = [sr.Contender(sr.PLAIN, None), sr.Contender("ngram", dict(raced))]
    tie = _row(0.99, lo=0.95)

    def lv(level, winner, row, name="ngram"):
        return {"level": level, "winner": winner, "contenders": {sr.PLAIN: {"vs_plain": 1.0}, name: row}}

    out = [lv(1, "ngram", _row(1.3)), lv(4, sr.PLAIN, tie), lv(16, sr.PLAIN, _row(0.9, lo=0.85))]
    chosen, why = sd.decision(cs, out, levels, plugin=True)
    assert why["draft_length_by_level"] == {1: 4, 4: 0, 16: 0} and chosen.plugin and why["plugin"]
    assert chosen.speculative["num_speculative_tokens_per_batch_size"] == [[1, 3, 4], [4, 256, 0]]
    chosen, why = sd.decision(cs, out, levels)  # without: the tie keeps its length, the loss goes to 0
    assert why["draft_length_by_level"] == {1: 4, 4: 4, 16: 0} and not chosen.plugin
    suffix = [sr.Contender(sr.PLAIN, None), sr.Contender("suffix", {"method": "suffix"})]
    out = [lv(1, "suffix", _row(1.4), "suffix"), lv(4, "suffix", _row(1.2), "suffix"),
           lv(16, sr.PLAIN, _row(0.8, lo=0.75), "suffix")]
    assert sd.decision(suffix, out, levels)[0] is None  # cannot be switched off without the plugin
    chosen, why = sd.decision(suffix, out, levels, plugin=True)
    assert chosen.plugin and chosen.speculative["num_speculative_tokens_per_batch_size"] == [[1, 15, 32], [16, 256, 0]]


def test_the_main_job_races_unresolved_levels_again_while_the_budget_holds_and_names_the_rest(monkeypatch, tmp_path):
    """The winner ties plain at 4 requests (its interval holds 1): passes continue there, the winner's and plain's
    each on a fresh server, until the budget ends; the level is then named unresolved in race.json, the summary
    and the report, and (with the plugin) written at K = 0."""
    summary, raced, race = _clocked_run(monkeypatch, tmp_path, ("ngram",), 30, lambda k, lv: 1.0 if lv == 4 else 1.3,
                                        plugin=True)
    planned = next(n for n in raced if n.startswith("planned"))
    assert raced.count(planned) >= 2 and raced.count(sr.CLOSING) >= 2, raced
    assert summary["unresolved"] == {planned: [4]} and race["unresolved"] == {planned: [4]}
    assert "Unresolved after every pass the budget held" in (tmp_path / "run" / "report.md").read_text()
    chosen = json.loads((tmp_path / "run" / "chosen.json").read_text())
    assert chosen["plugin"] and chosen["decision"]["draft_length_by_level"]["4"] == 0


@pytest.mark.parametrize("flag", [["--concurrency", "1,2"], ["--plugin", "on"], ["--workload", "w.jsonl"]])
def test_serving_flags_are_refused_on_a_step_engine(flag, tmp_path):
    r = subprocess.run([sys.executable, "-m", "planner", "autotune", *flag, "--out", str(tmp_path / "run")],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and f"{flag[0]}: only with a serving engine" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def _fake_levels(monkeypatch, gain):
    """sr.race_contender faked: each contender's rounds at the levels it is asked for, tokens/s = level x
    gain(name, level); returns {name: the levels it raced}."""
    seen = {}

    def fake(engine, c, race, lvls=None, into=None):
        lvls = list(lvls or race.levels)
        seen[c.name] = lvls
        for lv in lvls:
            tps = lv * (gain(c.name, lv) if c.speculative else 1.0)
            recs = [RequestRecord(i, 0.0, latency_s=(1 + 0.1 * i) * lv / tps, output_tokens=8, token_ids=list(range(8)))
                    for i in range(8)]
            race.results.setdefault(c.name, {})[lv] = [{"result": LoadResult(lv, 64 / tps, recs),
                                                        "counters": SpecDecodeCounters(), "server": 1}]
        return {"start_s": [], "level_s": {}}

    monkeypatch.setattr(sr, "race_contender", fake)
    return seen


def test_with_the_plugin_the_main_job_races_a_schedule_only_where_it_drafts(monkeypatch):
    """A schedule served with the plugin runs vLLM's plain path where its K = 0: the main job does not race it
    there (plain against itself), and its row there is plain's, neither ahead nor behind, never unresolved. The
    same schedule without the plugin (K = 0 keeps vLLM's speculative path) races every level, and the benchmark
    (skip_plain_path off) races every level with the plugin too: it measures what the user deploys."""
    from profiler.workload import Request

    levels = [1, 4, 16]
    seen = _fake_levels(monkeypatch, lambda name, lv: 1.3)
    cfg = {"method": "suffix", "num_speculative_tokens": 8, "num_speculative_tokens_per_batch_size": [[1, 3, 8],
                                                                                                     [4, 256, 0]]}
    reqs = [Request([{"role": "user", "content": f"q{i}"}], 8) for i in range(8)]
    for plugin, skip, raced_at in ((True, True, [1]), (False, True, levels), (True, False, levels)):
        race = sr.Race(sr.same_requests(reqs, reqs[:1], levels, 1, None, 60.0), levels, lambda line: None,
                       skip_plain_path=skip)
        mine = sr.Contender("planned suffix", cfg, plugin=plugin)
        sr.race_all(None, [sr.Contender(sr.PLAIN, None), mine], race)
        assert seen["planned suffix"] == raced_at, (plugin, skip)
        rows = {lv["level"]: lv["contenders"]["planned suffix"] for lv in race.rows()}
        assert sd.beats_plain(rows[1]) and race.rows()[0]["winner"] == "planned suffix"
        if raced_at != levels:
            assert race.plain_path == {"planned suffix": [4, 16]}
            for lv in (4, 16):
                assert rows[lv]["plain_path"] and rows[lv]["vs_plain"] == 1.0 and rows[lv]["requests"] == 0
                assert not sd.behind_plain(rows[lv]) and not sd.beats_plain(rows[lv]) and not sr.unresolved(rows[lv])
            # the decision: its own setting where ahead, K = 0 where it runs plain; the raced config as it is
            chosen, why = sd.decision([mine], race.rows(), levels, plugin=True)
            assert why["draft_length_by_level"] == {1: 8, 4: 0, 16: 0} and sd.raced_as_is(chosen, [mine]) is mine
            assert sd.measured_record(mine, race.rows(), levels)["vs_plain_by_level"] == pytest.approx(
                {1: 1.3, 4: 1.0, 16: 1.0})
            best, scores = sd.best_measured([mine], race.rows(), levels)
            assert best is mine and scores[mine.name] == pytest.approx(1.3 ** (1 / 3))
            assert sr.resolve(None, race, [mine], lambda: 1e9) == {}  # nothing left open: its level 1 is ahead
        else:
            assert not race.plain_path and all("plain_path" not in r for r in rows.values())
    plain = {"start_s": [50.0], "level_s": {1: [60.0], 4: [30.0], 16: [20.0]}, "wall_s": 160.0}
    c = sr.Contender("planned suffix", cfg, {1: 20.0, 4: 20.0, 16: 20.0}, plugin=True)
    tps = {1: 10.0, 4: 20.0, 16: 20.0}
    assert sr.predicted_seconds(c, plain, levels, 1, tps, skip_plain_path=True) == pytest.approx(50 + 30)
    assert sr.predicted_seconds(c, plain, levels, 1, tps) == pytest.approx(50 + 30 + 30 + 20)


def test_with_the_plugin_every_proposers_schedule_races_best_first_where_it_gains(tmp_path):
    """With the plugin each proposer's planned schedule is a contender, the best predicted first (the race
    decides between proposers the planner ranks within its own error), and a level whose planned K gains less
    than RACE_GAIN over plain is planned K = 0 (a race here cannot show it ahead; the decision writes K = 0
    there). Without the plugin one schedule, as planned."""
    levels = [1, 4, 16]
    profiles = _profiles(levels, per_token_s=0.016)  # suffix's K = 1 at 16 is predicted +4.7 %: raced K = 0
    high = {"accuracy": [[x] for x in [0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1]], "guesser": {"draft_passes": "one"}}
    low = {"accuracy": [[x] for x in [0.5, 0.3, 0.2, 0.1, 0.05, 0.0, 0.0, 0.0]], "guesser": {"draft_passes": "one"}}
    records = {"ngram": low, "suffix": high}
    s = sv.ServingSettings(concurrency=tuple(levels), methods=("ngram", "suffix"))
    for plugin in (True, False):
        cs = sp.planned_contenders(records, profiles, levels, s, {}, {lv: 0.0 for lv in levels}, tmp_path,
                                   lambda line: None, None, plugin=plugin)
        planned = [c for c in cs if c.name.startswith("planned")]
        plans = json.loads((tmp_path / "plans.json").read_text())["plans"]
        if not plugin:
            # suffix runs one length in stock vLLM (its plan is its fixed length), so ngram's schedule races too
            assert [c.name for c in planned] == ["planned ngram"] and any(c.name.startswith("fixed suffix") for c in cs)
            continue
        assert [c.name for c in planned] == ["planned suffix", "planned ngram"]
        for c in planned:
            p = plans[c.speculative["method"]]
            k = sd.k_by_level(c.speculative, levels)
            for lv in levels:
                gain = p["predicted"][str(lv)] / p["plain_predicted"][str(lv)]
                assert k[lv] == (p["per_level"][str(lv)] if gain >= 1 + sp.RACE_GAIN else 0), (c.name, lv, gain)
                assert p["raced_per_level"][str(lv)] == k[lv]
                if k[lv] == 0:
                    assert c.predicted[lv] == p["plain_predicted"][str(lv)]
                    assert lv not in c.priced or not p["per_level"][str(lv)]  # switched off here: priced as nothing
            # greedy: the plugin where a K = 0 must be vLLM's plain path, and for suffix's schedule (stock vLLM: one K)
            assert c.plugin == (0 in k.values() or c.speculative["method"] == "suffix")
        # the filter does bite here: some planned level gains under RACE_GAIN and is raced as plain's path
        assert any(plans[m]["per_level"][str(lv)] and not plans[m]["raced_per_level"][str(lv)]
                   for m in plans for lv in levels), plans


def test_with_the_plugin_the_second_proposers_schedule_races_before_the_fixed_length(monkeypatch, tmp_path):
    """The budget keeps no confirmation with the plugin (a decision that does not fit is written
    measured-safe), and the planned schedules race first in the planner's order: both proposers' schedules
    race before the fixed length and the stock settings."""
    _, raced, race = _clocked_run(monkeypatch, tmp_path, ("ngram", "suffix"), (170 + 2 * 175 + 200) / 60,
                                  lambda k, lv: 1.2 if lv < 16 else 0.9, plugin=True)
    planned = [n for n in raced if n.startswith("planned")]
    assert raced[0] == sr.PLAIN and len(planned) == 2 and raced[1:3] == planned, raced
    assert not any(n.startswith("fixed") or n.endswith("defaults") for n in raced), raced


def test_the_main_jobs_profile_samples_as_its_requests_do(monkeypatch, tmp_path):
    """The planner prices drafts on the profile: under sampling its steps must verify as the race's requests
    will (sampled verification cost 1.9x greedy's at 4 sequences and K = 4 here), with the plugin where it is on."""
    import profiler.vllm_profile as vp

    seen = []
    monkeypatch.setattr(vp, "profile_serving", lambda engine, spec, say=None: seen.append(spec) or {"points": []})
    s = sv.ServingSettings(concurrency=(1, 4), temperature=0.7, top_p=0.9, top_k=5)
    sv._profile(None, s, [1, 4], tmp_path, 100.0, lambda line: None, True)
    assert (seen[0].temperature, seen[0].top_p, seen[0].top_k, seen[0].plugin) == (0.7, 0.9, 5, True)
    assert seen[0].batch_sizes == (1, 4) and not seen[0].speculative_k0


def test_the_main_jobs_sampled_acceptance_counts_two_draws_and_greedy_one(monkeypatch, tmp_path):
    """One draw of the 16-request half measured suffix at 1.30-1.70 tokens a step by its seeds, and the first seeds'
    draw, the same in every run, sat under the race's: sampled, the acceptance half is sent twice (other seeds)."""
    import profiler.vllm_accept as va

    seen = []
    monkeypatch.setattr(va, "measure_methods", lambda *a, **kw: seen.append(kw) or {})
    for temperature, passes in ((0.7, sv.SAMPLED_ACCEPT_PASSES), (0.0, 1)):
        s = sv.ServingSettings(methods=("ngram", "eagle3"), temperature=temperature, top_p=0.9)
        sv._acceptance(None, s, ["r"], {}, tmp_path, lambda line: None, True)
        assert (seen[-1]["passes"], seen[-1]["concurrency"], seen[-1]["drafter_concurrency"]) == (
            passes, sv.ACCEPT_CONCURRENCY, sv.DRAFTER_ACCEPT_CONCURRENCY)


def test_an_interrupt_while_profiling_stops_the_main_job_with_the_steps_measured_kept(monkeypatch, tmp_path):
    """profile_serving keeps a partial profile on Ctrl-C or SIGTERM and returns (planner profile's contract); the
    main job went on to accept and race on it, so a stop during its first phase did not stop it."""
    import profiler.vllm_profile as vp

    cut = {"points": [{"batch_size": 1}], "incomplete": [{"reason": "interrupted"}]}
    monkeypatch.setattr(vp, "profile_serving", lambda engine, spec, say=None: cut)
    s = sv.ServingSettings(concurrency=(1, 4))
    with pytest.raises(KeyboardInterrupt):
        sv._profile(None, s, [1, 4], tmp_path, 100.0, lambda line: None)
    assert json.loads((tmp_path / "profile.json").read_text()) == cut
    whole = {"points": [{"batch_size": 1}], "incomplete": [{"reason": "time budget"}]}
    monkeypatch.setattr(vp, "profile_serving", lambda engine, spec, say=None: whole)
    assert sv._profile(None, s, [1, 4], tmp_path, 100.0, lambda line: None) == tmp_path / "profile.json"
