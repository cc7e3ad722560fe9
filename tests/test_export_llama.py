"""planner export --engine llama-server (planner/export_llama.py), and the random-filled GGUF presets
(decoder/engines/llama_cpp/gguf_random.py) that profile architectures without weights."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from planner.errors import UserError
from planner.export_llama import REMOVED_FLAGS, best_chain, llama_server_export
from planner.tree import Tree, TreeState

ROOT = Path(__file__).resolve().parents[1]
SERVER = Path(os.environ.get("TREE_PLANNER_CACHE") or Path.home() / ".cache" / "tree-planner") / "llama-server" / "bin" / "llama-server"


def chain(depth: int, guesser: str = "lookup") -> Tree:
    nodes = [(0,) * d for d in range(1, depth + 1)]
    return Tree("medusa", [TreeState(0, nodes, 1.5, 1 + depth)], 1.5, settings={"guesser": guesser}, engine="llama.cpp")


def test_best_chain_pays_only_when_acceptance_beats_the_wider_step():
    cost = np.array([1.0, 1.8, 2.3, 2.7])  # L(n)/L(1) on this CPU: compute-bound
    assert best_chain(np.array([0.5, 0.5, 0.5]), cost)[0] == 0  # 1.5 / 1.8 < 1
    k, rate = best_chain(np.array([0.95, 0.95, 0.95]), cost)
    assert k == 3 and rate == pytest.approx((1 + 0.95 + 0.95**2 + 0.95**3) / 2.7)


def test_lookup_chain_maps_to_ngram_simple():
    e = llama_server_export(chain(5), "m.gguf", 2)
    args = e.command
    assert args[:3] == ["llama-server", "-m", "m.gguf"] and "-fa" in args and args[args.index("-np") + 1] == "1"
    assert args[args.index("--spec-type") + 1] == "ngram-simple"
    assert args[args.index("--spec-ngram-simple-size-m") + 1] == "5"
    assert args[args.index("--spec-ngram-simple-size-n") + 1] == "3"
    assert not set(args) & set(REMOVED_FLAGS)
    assert any("n-gram size" in n for n in e.notes)


def test_plain_trees_hybrids_and_drafts():
    plain = Tree("medusa", [TreeState(0, [], 1.0, 1)], 1.0, settings={"guesser": "plain"})
    assert "--spec-type" not in llama_server_export(plain, "m.gguf", 2).command
    tree = Tree("medusa", [TreeState(0, [(0,), (1,), (0, 0)], 1.5, 4)], 1.5, settings={"guesser": "lookup+draft"})
    e = llama_server_export(tree, "m.gguf", 2)
    assert any(n.startswith("hybrid dropped") for n in e.notes) and any(n.startswith("tree dropped") for n in e.notes)
    with pytest.raises(UserError, match="GGUF"):
        llama_server_export(chain(3, "draft"), "m.gguf", 2)
    d = llama_server_export(chain(3, "draft"), "m.gguf", 2, draft_model="d.gguf", draft_p_min=0.7)
    a = d.command
    assert a[a.index("-md") + 1] == "d.gguf" and a[a.index("--spec-draft-n-max") + 1] == "3"
    assert a[a.index("--spec-draft-p-min") + 1] == "0.7"
    with pytest.raises(UserError, match="--threads"):
        llama_server_export(chain(3), "m.gguf", 0)


def test_dynamic_lookup_plan_takes_the_smallest_paying_match():
    from planner.dynamic import DynamicSpec, GuesserModel

    cost = [1.0, 1.8, 2.3, 2.7, 3.1]
    prior = np.array([[0.97], [0.97], [0.97], [0.97]])  # no calibration: the prior for every match length
    spec = DynamicSpec(4, cost, {"lookup": GuesserModel("lookup", prior)}, max_depth=4)
    tree = Tree("dynamic", [TreeState(0, [], 1.0, 1)], 1.0, settings={"guesser": "lookup"}, dynamic=spec,
                engine="llama.cpp")
    e = llama_server_export(tree, "m.gguf", 2)
    assert e.settings == {"speculative": "ngram-simple", "size_n": 1, "size_m": 4}
    assert any(n.startswith("per-step sizing dropped") for n in e.notes)
    spec.guessers["lookup"] = GuesserModel("lookup", prior * 0.3)
    with pytest.raises(UserError, match="plain decoding is predicted fastest"):
        llama_server_export(tree, "m.gguf", 2)


def test_cli_prints_the_command_line(tmp_path):
    from planner.tree import save_tree

    save_tree(chain(4), tmp_path / "plan.json")
    r = subprocess.run([sys.executable, "-m", "planner", "export", "--engine", "llama-server", "--plan",
                        str(tmp_path / "plan.json"), "--model-file", "m.gguf", "--threads", "2", "-o",
                        str(tmp_path / "out.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("llama-server -m m.gguf -t 2")
    assert json.loads((tmp_path / "out.json").read_text())["engine"] == "llama-server"
    r = subprocess.run([sys.executable, "-m", "planner", "export", "--engine", "vllm", str(tmp_path / "plan.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "-o FILE is required" in r.stderr


@pytest.mark.skipif(not SERVER.is_file(), reason="llama-server not built (scripts/build_llama_server.sh)")
def test_every_flag_is_the_real_servers():
    """The flags we write are in the built llama-server's --help; the ones it removed are not written."""
    help_text = subprocess.run([str(SERVER), "--help"], capture_output=True, text=True, timeout=60).stdout
    for plan, extra in ((chain(4), {}), (chain(3, "draft"), {"draft_model": "d.gguf", "draft_p_min": 0.5})):
        for flag in (a for a in llama_server_export(plan, "m.gguf", 2, **extra).command[1:] if a.startswith("-")):
            assert flag in help_text, flag
    assert "the argument has been removed" in help_text


def test_random_gguf_loads_in_llama_cpp(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    import decoder.engines.models as models
    from decoder.engines.llama_cpp.engine import LlamaEngine
    from decoder.engines.llama_cpp.gguf_random import random_gguf, remove_random_gguf

    monkeypatch.setenv("TREE_PLANNER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "mini.json").write_text(json.dumps({
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1024, "tie_word_embeddings": True}))
    (tmp_path / "presets" / "odd.json").write_text(json.dumps({
        "hidden_size": 200, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 1024}))
    monkeypatch.setattr(models, "PRESET_DIR", tmp_path / "presets")
    path = random_gguf("mini", "Q4_K", progress=False)
    eng = LlamaEngine(path, threads=1, n_ctx=512)
    import torch

    logits = eng.teacher_forced(torch.arange(24)).logits
    assert logits.shape == (24, 1024) and torch.isfinite(logits).all()
    eng.close()
    with pytest.raises(UserError, match="multiples of 256"):
        random_gguf("odd", "Q4_K", progress=False)
    assert not list((tmp_path / "cache" / "gguf").glob(".*tmp"))  # nothing half-written
    assert remove_random_gguf("mini") == [path] and not path.exists()
    shutil.rmtree(tmp_path / "cache")
