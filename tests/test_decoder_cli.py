"""`planner decode` and `planner accept`: outputs, and one-line errors for bad input."""
import json

import pytest
import torch
from test_decoder_utils import ppd_tree, static_tree

from planner.accept import load_acceptance
from planner.errors import UserError
from planner.tree import save_tree
from workflows.cli.main import main

torch.set_num_threads(1)


@pytest.fixture
def files(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["Hello there", "x"]}\n{"text": "Another prompt"}\n')
    return {
        "ppd": save_tree(ppd_tree(2, [0, 3, 6]), tmp_path / "ppd.json"),
        "medusa": save_tree(static_tree("medusa", 10, 3), tmp_path / "medusa.json"),
        "prompts": prompts,
        "dir": tmp_path,
    }


def test_decode_writes_results_identical_to_plain(files, capsys):
    out = files["dir"] / "out.json"
    rc = main(["decode", "--plan", str(files["ppd"]), "--model", "tiny", "--random-prompt-tokens", "2",
               "--prompts", str(files["prompts"]), "--max-new-tokens", "12", "--compare-plain", "-o", str(out),
               "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["identical_to_plain"] is True
    assert doc["summary"]["prompts"] == 2 and all(len(r["tokens"]) == 12 for r in doc["results"])
    assert doc["prompt_tokens"]["random"] is True and doc["real_input_length_by_state"]["2"] >= 1
    assert "speedup" in capsys.readouterr().out


def test_accept_writes_loadable_statistics(files):
    out = files["dir"] / "acc.json"
    tr = files["dir"] / "tr.json"
    rc = main(["accept", "--model", "tiny", "--random-prompt-tokens", "2", "--top-k-guesses", "3",
               "--prompts", str(files["prompts"]), "--max-new-tokens", "8", "-o", str(out),
               "--plan", str(files["ppd"]), "--transitions-output", str(tr), "--no-progress"])
    assert rc == 0
    acc = load_acceptance(str(out))
    doc = json.loads(out.read_text())
    assert acc.accuracy.shape == (2, 3)
    # distance 2 counts only rows whose rank-0 distance-1 guess was right (conditional acceptance; the
    # unconditional count would be 12 rows here whatever the guesses): the exact counts are checked
    # against brute force in test_acceptance_measure.py
    assert doc["conditional"] is True and doc["totals"][0] == 14 and doc["positions"] == 16
    assert doc["totals"][1] <= doc["counts"][0][0] and sum(doc["counts"][1]) <= doc["totals"][1] < 12
    t = json.loads(tr.read_text())
    assert sum(t["visits"]) > 0 and len(t["counts"]) == 3


def test_accept_with_prompt_lookup(files):
    """`planner accept --guesser lookup`: one guess per distance, the lookup's chain length deep."""
    out = files["dir"] / "acc-lookup.json"
    rc = main(["accept", "--model", "tiny", "--guesser", "lookup", "--prompts", str(files["prompts"]),
               "--max-new-tokens", "8", "-o", str(out), "--no-progress"])
    assert rc == 0
    assert load_acceptance(str(out)).accuracy.shape == (4, 1)


def test_decode_runs_autotunes_plain_decision(files):
    """autotune writes 'plain decoding' as a plan with no candidates and guesser plain: decode takes it."""
    from workflows.mainjob.write import plain_plan

    plan = save_tree(plain_plan("no plan measured faster than plain"), files["dir"] / "chosen.json")
    out = files["dir"] / "plain.json"
    rc = main(["decode", "--plan", str(plan), "--model", "tiny", "--prompts", str(files["prompts"]),
               "--max-new-tokens", "6", "--compare-plain", "-o", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["guesser"]["kind"] == "plain" and doc["summary"]["tokens_per_step"] == 1.0
    assert doc["summary"]["identical_to_plain"] is True


def test_accept_held_out_reads_only_held_out_questions(files, capsys):
    """--held-out: the MT-bench questions no shipped guesser trained on (question_id % 5 == 0)."""
    q = files["dir"] / "q.jsonl"
    q.write_text("\n".join(json.dumps({"question_id": i, "turns": [f"Question number {i}, please answer.", "x"]})
                           for i in range(81, 96)))
    out = files["dir"] / "acc-held.json"
    rc = main(["accept", "--model", "tiny", "--guesser", "lookup", "--prompts", str(q), "--held-out",
               "--max-new-tokens", "6", "-o", str(out), "--no-progress"])
    assert rc == 0 and json.loads(out.read_text())["prompts"] == 3  # questions 85, 90, 95
    q.write_text(json.dumps({"question_id": 81, "turns": ["x"]}))
    assert main(["accept", "--model", "tiny", "--guesser", "lookup", "--prompts", str(q), "--held-out",
                 "-o", str(out), "--no-progress"]) != 0
    assert "no held-out question" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["decode", "--plan", "{missing}", "--model", "tiny", "--random-prompt-tokens", "2"], "file not found"),
    (["decode", "--plan", "{medusa}", "--model", "tiny", "--random-prompt-tokens", "2", "--prompts", "{prompts}"],
     "the guesser guesses 2 distances"),
    (["decode", "--plan", "{ppd}", "--model", "tiny", "--random-prompt-tokens", "2", "--prompts", "{bad}"],
     "line 1: not valid JSON"),
    (["decode", "--plan", "{ppd}", "--model", "tiny", "--prompt-tokens", "{dir}", "--prompts", "{prompts}"],
     "prompt_tokens.json: file not found"),
    (["decode", "--plan", "{ppd}", "--model", "tiny", "--top-p", "0"], "--top-p"),
    (["accept", "--model", "tiny", "--random-prompt-tokens", "2", "-o", "{dir}/a.json", "--plan", "{ppd}"],
     "--plan needs --transitions-output"),
])
def test_bad_input_is_one_line_error(files, capsys, argv, message):
    (files["dir"] / "bad.jsonl").write_text("{not json\n")
    paths = {**{k: str(v) for k, v in files.items()}, "missing": str(files["dir"] / "nope.json"),
             "bad": str(files["dir"] / "bad.jsonl")}
    rc = main([a.format(**paths) for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith(f"planner {argv[0]}: error: ") and message in err and "\n" not in err


def test_decode_runs_a_pearl_plan_at_the_thread_split_autotune_measured():
    """autotune records PEARL's (target, drafter) threads in the plan; decode --plan resolves a RunConfig that
    runs that split (workflows/cli/run_config.py), and writes nothing into the parsed options."""
    from argparse import Namespace

    from planner.engines import kind
    from planner.tree import Tree, TreeState
    from workflows.cli.run_config import resolve_run

    def args():
        return Namespace(guesser=None, plan="RUN/trees/pearl-pearl-3.json", pearl=False, gamma=4, batch_size=1,
                         verify="greedy", mtad=None, pearl_serial=False, profile=None, threads=None, temperature=0.0,
                         top_k=0, top_p=1.0, eps=0.09, delta=0.3, max_new_tokens=8, seed=0, layout="packed",
                         max_perplexity_ratio=None, compare_plain=False)

    tree = Tree("medusa", [TreeState(0, [], 1.0, 1)], 1.0, settings={"guesser": "pearl", "pearl": {"gamma": 3, "threads": [1, 1]}})
    a = args()
    run = resolve_run(a, tree, kind("hf"), "ppd")
    assert run.pearl.gamma == 3 and run.pearl.threads == (1, 1) and run.guesser == "draft" and run.plan is None
    assert vars(a) == vars(args())  # resolved into an object, not written back
    assert "PEARL with gamma 3" in run.line()
    tree.settings["pearl"]["threads"] = [0, 1]
    with pytest.raises(UserError, match=r"pearl-pearl-3.json: settings.pearl.threads: expected \[target, drafter\]"):
        resolve_run(args(), tree, kind("hf"), "ppd")
    del tree.settings["pearl"]["threads"]  # plans written before the split was recorded: decode's default split
    assert resolve_run(args(), tree, kind("hf"), "ppd").pearl.threads is None


def test_a_flag_overrides_the_raced_setting_and_says_so(tmp_path):
    """A plan raced with 2 threads, decoded with --threads 1: the run takes the flag, the line says so."""
    from argparse import Namespace

    from planner.engines import kind
    from planner.tree import Tree, TreeState
    from workflows.cli.run_config import resolve_run

    tree = Tree("medusa", [TreeState(0, [], 1.0, 1)], 1.0, settings={"guesser": "lookup",
                                                                     "raced_with": {"engine": "hf", "threads": 2}})
    base = dict(guesser=None, plan=str(tmp_path / "chosen.json"), pearl=False, gamma=4, batch_size=1, verify="auto",
                mtad=None, pearl_serial=False, profile=None, temperature=0.0, top_k=0, top_p=1.0, eps=0.09, delta=0.3,
                max_new_tokens=8, seed=0, layout="packed", max_perplexity_ratio=None, compare_plain=False)
    raced = resolve_run(Namespace(**base, threads=None), tree, kind("hf"), "ppd")
    assert raced.threads == 2 and raced.line() == "decoding as raced: 2 threads (flags override)"
    flagged = resolve_run(Namespace(**base, threads=1), tree, kind("hf"), "ppd")
    assert flagged.threads == 1 and "--threads 1 instead of the raced 2" in flagged.line()
    assert raced.guesser == "lookup" and not raced.plain


@pytest.mark.parametrize("rule, same", [("coupled", True), ("lossless", None)])
def test_sampled_decode_compares_with_plain_sampling_under_the_coupled_rule(files, rule, same):
    """--compare-plain under sampling: with --verify coupled plain sampling uses the same noise, so the plan's
    text must be its text (compared as greedily); with the recursive-rejection rule each samples with its own
    draws and nothing is compared (null, not a false mismatch)."""
    out = files["dir"] / f"out-{rule}.json"
    rc = main(["decode", "--plan", str(files["ppd"]), "--model", "tiny", "--random-prompt-tokens", "2",
               "--prompts", str(files["prompts"]), "--max-new-tokens", "12", "--compare-plain", "-o", str(out),
               "--temperature", "0.8", "--top-p", "0.9", "--verify", rule, "--seed", "5", "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["identical_to_plain"] is same and doc["settings"]["verify"] == rule
    assert all(r["identical_to_plain"] is same for r in doc["results"])
