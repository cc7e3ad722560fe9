"""The project's vLLM plugin (vllm_plugin/, docs/vllm.md "The tree-planner plugin").

Without vLLM: the plugin's own names agree with the project's (planner/serving.py, planner/export.py),
it is no package of the project, and its rules (switch, versions, refusals) answer as documented.

With vLLM (scripts/setup_vllm.sh; skipped with the reason where it is absent, unless
TREE_PLANNER_REQUIRE_VLLM=1): tests/vllm_plugin_inside.py runs in vLLM's environment with the working
tree's plugin first on PYTHONPATH, one process per engine, each engine's core and worker in-process so
a probe counts what every step ran. SmolLM2, fp32, eager:
- vLLM's own plugin loader with the switch off, or with vLLM's version replaced by one the plugin was
  not tested with, leaves every vLLM method vLLM's own (one log line for the version);
- plain vLLM, and with the plugin: ngram with the schedule [[1, 1, 4], [2, 256, 0]], suffix decoding
  with K = 8 / 2 / 0 by batch size (stock vLLM's suffix proposer dies at the first K that differs), and
  SmolLM2 as its own draft model: greedy answers at 1, 2, 4 and 8 concurrent requests equal plain's;
  the probe shows every step without drafts on the plain sampler and no rejection sampler, no proposer
  call (ngram) or speculate call (suffix) and no draft fetch at K = 0, the draft model's first forward
  kept (its KV cache must stay whole), and the speculative path where drafts were scheduled;
- sampled (T 0.7, top-p 0.9): seeded answers equal plain's; on other seeds a chi-square test of the
  token frequencies at each position accepts the plugin and rejects the same plugin with its plain
  path's temperature dropped (a deliberately wrong rule), so the test can fail;
- suffix decoding after vLLM's prefix cache reset drafts step for step as before it saw the prompts (the
  plugin made it forget its cached answers; repeated without a reset, it drafts from them);
- served: `vllm serve` through the project's launcher with the plugin switched on logs that it acts
  and answers as plain does, and a reset through it makes suffix decoding forget (the line the race waits for).
"""
from __future__ import annotations

import collections
import importlib.util
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from decoder.engines.vllm import env as vllm_env
from planner.export import ENGINE_METHODS
from planner.vllm_plugin import PLUGIN_ENV, PLUGIN_FORGOT, PLUGIN_REFUSES, PLUGIN_SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIR = ROOT / "vllm_plugin"
INSIDE = ROOT / "tests" / "vllm_plugin_inside.py"
REQUIRED = os.environ.get("TREE_PLANNER_REQUIRE_VLLM") == "1"
LEVELS = (1, 2, 4, 8)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 256, 0]]}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8,
          "num_speculative_tokens_per_batch_size": [[1, 1, 8], [2, 3, 2], [4, 256, 0]]}
SAMPLED = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 3, "wave": 64}
N_SAMPLES = 300
ENGINE_TIMEOUT_S = 1200  # one engine: about a minute on a quiet 2-core CPU
QUESTIONS = ["Repeat exactly: one two three, one two three, one two three.", "What is the capital of France?",
             "Copy this line: alpha beta gamma delta alpha beta gamma delta.", "List the numbers from 1 to 10.",
             "Rewrite in plain words: the cat sat on the mat because the mat was warm.", "Say hello twice.",
             "Name three colours.", "Why is the sky blue?"]


def _gate():
    """The plugin's rules module, loaded from the tree (it imports nothing of vLLM)."""
    spec = importlib.util.spec_from_file_location("tree_planner_vllm_gate", PLUGIN_DIR / "tree_planner_vllm" / "gate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------- without vLLM

def test_the_plugin_and_the_project_name_the_same_switch_methods_and_version():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    gate = _gate()
    assert gate.SWITCH == PLUGIN_ENV == "TREE_PLANNER_VLLM_PLUGIN"
    assert set(gate.TESTED_METHODS) == set(ENGINE_METHODS["vllm"]) - PLUGIN_REFUSES
    assert set(gate.STEP_K_METHODS) == set(PLUGIN_SCHEDULES)
    assert gate.FORGOT == PLUGIN_FORGOT
    setup = (ROOT / "scripts" / "setup_vllm.sh").read_text()
    assert f"VLLM_VERSION={gate.TESTED_VLLM[0]}\n" in setup  # the environment builds the version the patches read
    entry = tomllib.loads((PLUGIN_DIR / "pyproject.toml").read_text())["project"]["entry-points"]
    assert entry == {"vllm.general_plugins": {"tree_planner": "tree_planner_vllm:register"}}


def test_the_plugin_is_not_a_package_of_the_project():
    from setuptools import find_packages

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from test_architecture import PACKAGES

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    found = find_packages(str(ROOT), include=include)
    assert found and not [p for p in found if "vllm_plugin" in p or p.startswith("tree_planner_vllm")]
    assert "tree_planner_vllm" not in PACKAGES and "vllm_plugin" not in PACKAGES
    assert not (PLUGIN_DIR / "__init__.py").exists()  # a distribution folder, not an importable package
    assert importlib.util.find_spec("tree_planner_vllm") is None  # `pip install -e .` did not bring it along


def test_the_switch_and_the_versions():
    gate = _gate()
    for value, on in (("1", True), ("true", True), ("on", True), ("", False), ("0", False), ("no", False)):
        assert gate.switched_on({gate.SWITCH: value}) is on
    assert gate.switched_on({}) is False
    assert gate.tested_version("0.32.0") and gate.tested_version("0.32.0+cpu")
    assert not gate.tested_version("0.32.1") and not gate.tested_version("0.31.0")


def _nucleus():
    spec = importlib.util.spec_from_file_location("tree_planner_vllm_nucleus", PLUGIN_DIR / "tree_planner_vllm" / "nucleus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _top_p_by_sort(logits, top_p):
    """The nucleus by its definition, one row at a time: sort descending, keep a token while the tokens before
    it hold less than p."""
    import torch

    out = torch.full_like(logits, float("-inf"))
    for r in range(logits.shape[0]):
        probs = logits[r].double().softmax(-1)
        order = probs.argsort(descending=True)
        above = probs[order].cumsum(0) - probs[order]
        keep = order[above < float(top_p[r])]
        out[r, keep] = logits[r, keep]
    return out


def test_the_plugins_top_p_keeps_the_nucleus_a_sort_keeps_and_leaves_wide_ones_to_the_sort():
    """The CPU patch of the rejection sampler's top-p (patches.py): the tokens it keeps are the nucleus by its
    definition, on rows from peaked to flat, mixed with rows at top-p 1 (left whole); a row whose nucleus holds
    more than the largest candidate count is refused (None, the logits untouched) for vLLM's sort to do."""
    torch = pytest.importorskip("torch")
    nucleus = _nucleus()
    gen = torch.Generator().manual_seed(0)
    vocab = 5000
    for scale in (8.0, 6.0, 4.0):  # peaked (a handful of tokens) to wide (hundreds: the second candidate count)
        logits = torch.randn(6, vocab, generator=gen) * scale
        top_p = torch.tensor([0.9, 0.5, 1.0, 0.99, 0.1, 0.9])
        want = _top_p_by_sort(logits, top_p)
        want[2] = logits[2]  # top-p 1: the whole row
        got = nucleus.top_p_filter(logits.clone(), top_p)
        assert got is not None and torch.equal(torch.isinf(got), torch.isinf(want)), scale
        assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(want)])
        assert (~torch.isinf(got[4])).sum() >= 1  # the likeliest token always stays
    flat = torch.zeros(2, vocab)  # every token alike: the nucleus at 0.9 is 4,500 tokens
    assert nucleus.top_p_filter(flat, torch.tensor([0.9, 0.9])) is None and torch.equal(flat, torch.zeros(2, vocab))
    small = torch.zeros(1, 100)  # a vocabulary the candidates cover: filtered, not refused
    assert (~torch.isinf(nucleus.top_p_filter(small, torch.tensor([0.555])))).sum() == 56
    whole = torch.randn(3, vocab, generator=gen)
    assert nucleus.top_p_filter(whole.clone(), torch.ones(3)).equal(whole)


def _config(method="ngram", **over):
    """A stand-in for vLLM's VllmConfig with the fields gate.refusal reads (the real one is read in vLLM below)."""
    spec = SimpleNamespace(method=method, draft_tensor_parallel_size=None, disable_padded_drafter_batch=False,
                           parallel_drafting=False, rejection_sample_method="standard")
    cfg = SimpleNamespace(
        speculative_config=spec, use_v2_model_runner=False, kv_transfer_config=None,
        model_config=SimpleNamespace(is_hybrid=False, has_inner_state=False, is_attention_free=False),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1, data_parallel_size=1))
    for path, value in over.items():
        obj, _, name = path.rpartition("__")
        setattr(getattr(cfg, obj) if obj else cfg, name, value)
    return cfg


@pytest.mark.parametrize("over, reason", [
    ({"speculative_config": None}, "nothing to do"),
    ({"speculative_config__method": "mtp"}, "method 'mtp' is not one it was tested with"),
    ({"speculative_config__method": "custom_class"}, "not one it was tested with"),
    ({"model_config__is_hybrid": True}, "recurrent state"),
    ({"model_config__has_inner_state": True}, "recurrent state"),
    ({"use_v2_model_runner": True}, "Model Runner V2"),
    ({"scheduler_config__async_scheduling": True}, "async scheduling"),
    ({"parallel_config__pipeline_parallel_size": 2}, "pipeline parallelism"),
    ({"parallel_config__tensor_parallel_size": 2}, "tensor parallelism"),
    ({"parallel_config__data_parallel_size": 2}, "data parallelism"),
    ({"speculative_config__draft_tensor_parallel_size": 2}, "tensor-parallel drafter"),
    ({"speculative_config__disable_padded_drafter_batch": True}, "disable_padded_drafter_batch"),
    ({"speculative_config__parallel_drafting": True}, "parallel_drafting"),
    ({"speculative_config__rejection_sample_method": "synthetic"}, "'synthetic'"),
    ({"kv_transfer_config": object()}, "KV transfer"),
])
def test_what_the_plugin_refuses_is_one_line_with_the_reason(over, reason):
    gate = _gate()
    for method in gate.TESTED_METHODS:
        assert gate.refusal(_config(method), platform_is_cpu=True) is None
    said = gate.refusal(_config(**over), platform_is_cpu=True)
    assert said and reason in said and "\n" not in said
    assert "platform other than vLLM's CPU backend" in gate.refusal(_config(), platform_is_cpu=False)


# ---------------------------------------------------------------------------------------------- in vLLM

def _require_vllm() -> Path:
    python = vllm_env.venv_python()
    if python is None:
        reason = f"the vLLM environment {vllm_env.venv_dir()} is not set up (bash {vllm_env.SETUP})"
        if REQUIRED:
            pytest.fail(f"TREE_PLANNER_REQUIRE_VLLM=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return python


def _inside(python: Path, mode: str, request: dict, tmp: Path, switch: str) -> dict:
    """tests/vllm_plugin_inside.py in vLLM's environment, the tree's plugin first on its path."""
    req, res = tmp / f"{mode}-request.json", tmp / f"{mode}-result.json"
    res.unlink(missing_ok=True)
    req.write_text(json.dumps(request))
    env = dict(os.environ, PYTHONPATH=str(PLUGIN_DIR), VLLM_CPU_KVCACHE_SPACE="2", **{PLUGIN_ENV: switch})
    try:
        proc = subprocess.run([str(python), str(INSIDE), mode, str(req), str(res)], env=env, cwd=str(tmp),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=ENGINE_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"vllm_plugin_inside.py {mode} took over {ENGINE_TIMEOUT_S} s ({request.get('config')})", pytrace=False)
    if proc.returncode != 0 or not res.is_file():
        tail = "\n".join(proc.stdout.splitlines()[-25:])
        pytest.fail(f"vllm_plugin_inside.py {mode} failed (exit {proc.returncode}):\n{tail}", pytrace=False)
    # the plugin's lines as vLLM printed them (its logging, configured while the engine starts)
    return dict(json.loads(res.read_text()), log=[ln for ln in proc.stdout.splitlines() if "tree-planner plugin" in ln])


def _has_arctic(python: Path) -> bool:
    from workflows.export.vllm import suffix_available

    return suffix_available(python)


@pytest.fixture(scope="module")
def python() -> Path:
    return _require_vllm()


@pytest.fixture(scope="module")
def smollm2(python) -> Path:
    from decoder.engines.shipped import model_dir

    return model_dir("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def prompts(smollm2) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)

    def ids(q: str) -> list[int]:
        p = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        return list(map(int, p["input_ids"] if hasattr(p, "keys") else p))  # transformers 5: a BatchEncoding

    # sampled: a short raw prompt with many likely continuations (cheap to prefill 3 x 300 times)
    return {"greedy": [ids(q) for q in QUESTIONS], "sampled": list(map(int, tok("My favourite animal is the")["input_ids"]))}


PATCHED = ["EngineCore.post_step", "EngineCore.reset_prefix_cache", "GPUModelRunner.__init__", "GPUModelRunner._prepare_inputs",
           "GPUModelRunner.propose_draft_token_ids", "MedusaProposer.propose", "Scheduler.__init__", "Scheduler.schedule",
           "SuffixDecodingProposer.propose", "rejection_sampler.apply_top_k_top_p", "rejection_sampler.expand_batch_to_tokens"]


def test_the_loader_leaves_vllm_untouched_when_off_or_on_an_untested_version(runs):
    off, old = runs["plain"]["register"]["cases"]  # vLLM's loader, in the plain engine's process before its start
    assert off == {"patched": [], "lines": []}  # nothing at all, not even a line
    assert old["patched"] == [] and len(old["lines"]) == 1
    assert "vLLM 0.31.0 is not a version it was tested with (0.32.0); nothing patched" in old["lines"][0]
    assert runs["plain"]["patched"] == [] and runs["plain"]["log"] == []  # its engine, the switch off: untouched
    assert runs["ngram"]["patched"] == PATCHED, "the entry point did not patch vLLM: re-run bash scripts/setup_vllm.sh"


@pytest.fixture(scope="module")
def heads(smollm2, tmp_path_factory) -> dict[str, Path]:
    """vLLM drafter folders for SmolLM2: an EAGLE-3 head started from the target and perturbed (it guesses
    right often, so drafts get accepted), in the released layout (tests/head_layouts.py); three Medusa heads in
    vLLM's layout, random residual blocks over the target's own LM head."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from head_layouts import trained_like_head, write_eagle3

    d = tmp_path_factory.mktemp("heads")
    target = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    eagle3 = write_eagle3(trained_like_head(target), d / "eagle3")
    H, V = target.config.hidden_size, target.config.vocab_size
    del target
    with safe_open(str(smollm2 / "model.safetensors"), "pt") as f:
        head = f.get_tensor("model.embed_tokens.weight")  # SmolLM2 ties its LM head to the embedding
    g = torch.Generator().manual_seed(0)
    tensors = {f"blocks.{h}.layers.0.weight": torch.randn(H, H, generator=g) / H ** 0.5 for h in range(3)}
    medusa = d / "medusa"
    medusa.mkdir()
    save_file({**tensors, "lm_head.weight": head.contiguous()}, str(medusa / "model.safetensors"))
    (medusa / "config.json").write_text(json.dumps({
        "model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": 3, "num_hidden_layers": 1,
        "hidden_size": H, "vocab_size": V, "original_lm_head": True}))
    return {"eagle3": eagle3, "medusa": medusa}


def _engines(smollm2: Path, heads: dict[str, Path]) -> dict[str, tuple[dict, tuple[int, ...]]]:
    """name -> (speculative config served with the plugin, the levels its greedy answers are checked at)."""
    return {
        "ngram": (NGRAM, LEVELS),
        "suffix": (SUFFIX, LEVELS),
        "draft_model": ({"method": "draft_model", "model": str(smollm2), "num_speculative_tokens": 3,
                         "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 256, 0]]}, LEVELS),
        "eagle3": ({"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 3,
                    "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 256, 0]]}, (1, 4)),
        "medusa": ({"method": "medusa", "model": str(heads["medusa"]), "num_speculative_tokens": 3,
                    "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 2, 1], [3, 256, 0]]}, (1, 2, 4)),
    }


@pytest.fixture(scope="module")
def served(python, smollm2, prompts, tmp_path_factory):
    """A `vllm serve` through the project's launcher with the plugin switched on (K = 0 at every batch size),
    launched first so it starts while the engines below run; answered in `runs`."""
    from decoder.engines.vllm.open import VllmEngine
    from planner.engines import kind

    engine = VllmEngine(python, smollm2, "smollm2-135m", kind("vllm").caps)
    # suffix decoding (ngram without arctic-inference) at K = 0: the suffix tree is still fed, so a reset
    # has answers to forget
    cfg = dict(SUFFIX if _has_arctic(python) else NGRAM, num_speculative_tokens_per_batch_size=[[1, 256, 0]])
    server = engine.server(cfg, plugin=True, env={"PYTHONPATH": str(PLUGIN_DIR)},
                           log_path=tmp_path_factory.mktemp("served") / "vllm.log")
    server.launch()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def runs(python, smollm2, prompts, heads, served, tmp_path_factory) -> dict:
    """Every engine's answers and per-step probe, and the served answers (module docstring)."""
    from profiler.load_generator import TokenRequest, run_load

    tmp = tmp_path_factory.mktemp("plugin")
    greedy = {"levels": list(LEVELS), "prompts": prompts["greedy"], "max_tokens": 32}
    seeds = {"A": list(range(N_SAMPLES)), "B": list(range(1000, 1000 + N_SAMPLES)),
             "wrong": list(range(2000, 2000 + N_SAMPLES))}
    sampled = dict(SAMPLED, prompt=prompts["sampled"])
    plain = {"model": str(smollm2), "config": None, "greedy": greedy, "sampled": dict(sampled, seeds={"A": seeds["A"]}),
             "register": {"cases": [{"switch": "0"}, {"switch": "1", "version": "0.31.0"}]}}
    out = {"plain": _inside(python, "engine", plain, tmp, "0")}  # the switch off: vLLM as it ships
    for name, (cfg, levels) in _engines(smollm2, heads).items():
        if name == "suffix" and not _has_arctic(python):
            continue
        request = {"model": str(smollm2), "config": cfg, "greedy": dict(greedy, levels=list(levels))}
        if name == "suffix":  # one request at a time: K = 8 in SUFFIX's schedule
            request["forget"] = {"prompts": prompts["greedy"][:2], "max_tokens": greedy["max_tokens"]}
        if name == "ngram":
            request["sampled"] = dict(sampled, seeds=seeds, wrong=["wrong"])
        out[name] = _inside(python, "engine", request, tmp, "1")
    # Sampled requests whose every step has drafts: the target drafting for itself (K = 2 at every batch size)
    drafted = {"model": str(smollm2), "config": {"method": "draft_model", "model": str(smollm2), "num_speculative_tokens": 2},
               "sampled": dict(sampled, seeds={"B": seeds["B"], "wrong": seeds["wrong"]}, wrong=["wrong"], wrong_path="spec")}
    out["sampled drafts"] = _inside(python, "engine", drafted, tmp, "1")
    served.wait_healthy()
    request = TokenRequest(prompts["greedy"][0], greedy["max_tokens"], {"temperature": 0})
    result = run_load(served.url, served.served_model_name, [request], concurrency=1, timeout_s=300)
    forgot = None
    if served.speculative_config["method"] == "suffix":
        try:
            served.reset_prefix_cache(forget_answers=True)  # the race's reset between passes of repeated requests
            forgot = "forgot"
        except Exception as e:  # what the test reports
            forgot = str(e)
    out["served"] = {"tokens": [r.token_ids for r in result.records], "errors": [r.error for r in result.records],
                     "log": Path(served.log_path).read_text(errors="replace"), "forgot": forgot,
                     "method": served.speculative_config["method"]}
    return out


METHODS = ["ngram", "suffix", "draft_model", "eagle3", "medusa"]


@pytest.mark.parametrize("name", METHODS)
def test_greedy_answers_equal_plains_at_every_level(runs, name):
    if name not in runs:
        _missing("suffix decoding unchecked")
    assert runs["plain"]["patched"] == [] and runs[name]["patched"] == PATCHED  # plain ran with the switch off
    assert runs[name]["greedy"]
    for level, answers in runs[name]["greedy"].items():
        assert answers == runs["plain"]["greedy"][level], f"{name} at {level} requests"
    said = [line for line in runs[name]["log"] if (" INFO " in line or " WARNING " in line) and PLUGIN_FORGOT not in line]
    assert len(said) == 1 and f"tree-planner plugin: on for {name}:" in said[0], said  # one line per engine


def _greedy_steps(run: dict) -> list[dict]:
    return [s for s in run["steps"] if s["phase"].startswith("greedy")]


@pytest.mark.parametrize("name", METHODS)
def test_a_step_without_drafts_skips_the_speculative_path(runs, name):
    if name not in runs:
        _missing("suffix decoding unchecked")
    steps = _greedy_steps(runs[name])
    plain_steps = [s for s in steps if s["drafts"] == 0]
    spec_steps = [s for s in steps if s["drafts"] > 0]
    assert plain_steps and spec_steps  # both kinds ran: K > 0 at one request, K = 0 above
    assert all(s["path"] == "plain" and s["rejection"] == 0 for s in plain_steps)
    assert all(s["path"] == "spec" and s["rejection"] == 1 for s in spec_steps)  # the probe sees the speculative path
    k0 = [s for s in steps if s["k"] == 0]
    assert k0 and all(s["fetch"] == 0 for s in k0)  # no draft fetch after a K = 0 step
    assert all(s["fetch"] == 1 for s in steps if s["k"] > 0)
    if name in ("ngram", "medusa"):  # nothing to feed: not called at K = 0
        assert all(s["proposer"] == 0 for s in k0) and any(s["proposer"] for s in steps if s["k"] > 0)
    if name == "suffix":  # the suffix tree is fed every step, asked only at K > 0
        assert all(s["proposer"] == 1 and s["speculate"] == 0 for s in k0)
        assert any(s["speculate"] for s in steps if s["k"] > 0)
    if name in ("draft_model", "eagle3"):  # its first forward keeps the drafter's KV cache whole for later drafts
        assert all(s["proposer"] == 1 for s in steps)
    plain = _greedy_steps(runs["plain"])
    assert plain and all(s["path"] == "plain" and s["k"] == 0 for s in plain)


def _longest_draft_by_k(run: dict) -> dict[int, int]:
    """A step's K -> the longest draft proposed at it (the next step schedules it)."""
    steps = _greedy_steps(run)
    out: dict[int, int] = {}
    for before, step in zip(steps, steps[1:]):
        if step["phase"] == before["phase"]:
            out[before["k"]] = max(out.get(before["k"], 0), step["longest_draft"])
    return out


def test_suffix_and_medusa_take_the_steps_k_from_the_schedule(runs):
    """Three draft lengths in one engine each: stock vLLM's proposer asserts one and its worker died at the first
    batch size whose K differed."""
    if "suffix" not in runs:
        _missing("suffix decoding unchecked")
    suffix = _longest_draft_by_k(runs["suffix"])
    assert {0, 2, 8} <= set(suffix), suffix
    assert suffix[0] == 0 and suffix[2] == 2 and suffix[8] > 2
    medusa = _longest_draft_by_k(runs["medusa"])
    assert medusa == {0: 0, 1: 1, 3: 3}, medusa  # Medusa drafts exactly K, from its first K heads


def _phase_drafts(run: dict, phase: str) -> list[tuple[int, int]]:
    return [(s["drafts"], s["longest_draft"]) for s in run["steps"] if s["phase"] == phase]


def test_a_reset_makes_suffix_decoding_forget_earlier_answers(runs):
    """vLLM's reset_prefix_cache leaves suffix decoding's cached answers, so prompts repeated after it draft
    from their own earlier answers; with the plugin the drafter after a reset drafts step for step as it
    did before it had seen them, one log line per reset saying how many answers it forgot. The repeat
    without a reset is the control: it drafts differently, so the comparison can fail."""
    if "suffix" not in runs:
        _missing("suffix decoding unchecked")
    forget, run = runs["suffix"]["forget"], runs["suffix"]
    assert forget["resets"] == [True, True]
    assert forget["forget first"] == forget["forget repeated"] == forget["forget after reset"]  # greedy: the same
    assert len(forget["forget first"]) == 2  # the two prompts; the first alone, as plain answers it:
    assert forget["forget first"][0] == runs["plain"]["greedy"]["1"][0]
    first, again, after = (_phase_drafts(run, f"forget {p}") for p in ("first", "repeated", "after reset"))
    assert first and after == first
    assert len(again) < len(first)  # the same answers in fewer steps: it drafted them from its own earlier ones
    lines = [ln for ln in run["log"] if PLUGIN_FORGOT in ln]
    assert len(lines) == 2, run["log"]
    # the first reset forgot the greedy levels' answers (1 + 2 + 4 + 8) and those of before: 15 at least;
    # the second, the 4 answers of the two phases since
    assert int(lines[0].rsplit(":", 1)[1]) >= 15 and int(lines[1].rsplit(":", 1)[1]) == 4


def _homogeneity_p(a: list[list[int]], b: list[list[int]]) -> float:
    """Chi-square test that two sample sets draw their tokens from one distribution, position by position
    (tokens seen fewer than 10 times pooled), Bonferroni over the positions."""
    from scipy.stats import chi2_contingency

    positions = max(map(len, a + b))
    ps = []
    for pos in range(positions):
        ca = collections.Counter(x[pos] if len(x) > pos else -1 for x in a)
        cb = collections.Counter(x[pos] if len(x) > pos else -1 for x in b)
        keep = sorted(k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 10)
        rows = [[c[k] for k in keep] + [sum(c.values()) - sum(c[k] for k in keep)] for c in (ca, cb)]
        rows = [list(col) for col in zip(*[c for c in zip(*rows) if sum(c) > 0])]
        ps.append(chi2_contingency(rows)[1])
    return min(1.0, min(ps) * positions)


def test_sampling_keeps_plains_distribution_and_a_wrong_rule_is_caught(runs):
    plain, plugin = runs["plain"]["sampled"], runs["ngram"]["sampled"]
    assert len(plain["A"]) == len(plugin["A"]) == N_SAMPLES
    assert plugin["A"] == plain["A"]  # seeded: the plain sampler on the same generators
    sampled_steps = [s for s in runs["ngram"]["steps"] if s["phase"].startswith("sampled")]
    assert sampled_steps and all(s["path"] == "plain" and s["rejection"] == 0 for s in sampled_steps)
    assert len({tuple(x) for x in plain["A"]}) > 50  # a prompt with many likely answers: the test has power
    assert _homogeneity_p(plain["A"], plugin["B"]) > 1e-3
    assert _homogeneity_p(plain["A"], plugin["wrong"]) < 1e-6  # temperature dropped on the plain path: caught
    assert plugin["wrong"] != plugin["B"]


def test_sampled_drafts_are_verified_at_the_requests_temperature(runs):
    """The speculative path under sampling. vLLM 0.32's CPU build verified drafted positions at an uninitialised
    temperature and top-p (patches.py, `expand_batch_to_tokens`), so its sampled speculative decoding accepted
    almost nothing and emitted tokens plain never would; with the plugin the drafted positions follow plain's
    distribution, and verifying them against the raw distribution (T = 1, top-p 1 instead of the request's 0.7
    and 0.9) is caught."""
    plain, drafted = runs["plain"]["sampled"], runs["sampled drafts"]["sampled"]
    assert runs["sampled drafts"]["patched"] == PATCHED
    assert len(drafted["B"]) == len(drafted["wrong"]) == N_SAMPLES
    for name in ("B", "wrong"):
        steps = [s for s in runs["sampled drafts"]["steps"] if s["phase"] == f"sampled {name}"]
        decode = [s for s in steps if s["drafts"] > 0]
        assert decode and all(s["path"] == "spec" and s["rejection"] == 1 for s in decode)
        assert len(decode) >= len(steps) // 2  # after each wave's prefill, every step verifies drafts
    assert _homogeneity_p(plain["A"], drafted["B"]) > 1e-3
    assert _homogeneity_p(plain["A"], drafted["wrong"]) < 1e-6


def test_served_with_the_plugin_it_acts_and_answers_as_plain(runs):
    served = runs["served"]
    assert served["errors"] == [None]
    assert served["tokens"] == runs["plain"]["greedy"]["1"]
    acts = [ln for ln in served["log"].splitlines() if f"tree-planner plugin: on for {served['method']}" in ln]
    assert len(acts) == 1, served["log"][-3000:]  # one line, from the engine core


def test_served_suffix_forgets_its_answers_on_a_reset(runs):
    """Through `vllm serve` (engine core and worker in processes of their own: the worker is reached by
    collective_rpc): the reset the race makes between passes, and the plugin's line that the server waits
    for, saying it forgot the one answer served before it."""
    served = runs["served"]
    if served["method"] != "suffix":
        _missing("suffix decoding unchecked")
    assert served["forgot"] == "forgot"
    assert [ln.rsplit(":", 1)[1].strip() for ln in served["log"].splitlines() if PLUGIN_FORGOT in ln] == ["1"]


def _missing(what: str):
    msg = f"{what}: arctic-inference is not installed in the vLLM environment (bash {vllm_env.SETUP})"
    if REQUIRED:
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)
