"""Every vLLM export the project writes, checked in vLLM itself (the environment of
scripts/setup_vllm.sh, run through workflows/export/vllm.py): vLLM's own engine config (SpeculativeConfig
and its checks) accepts each one, in one process that loads no weights. That the exports decode
exactly vLLM's plain greedy tokens is checked served, under concurrent load, in
tests/test_vllm_server.py (the ngram chain export and the main job's suffix export).
Where the environment is absent the tests skip with the reason, unless TREE_PLANNER_REQUIRE_VLLM=1
(`.ci/run` sets it after running scripts/setup_vllm.sh): then absence fails.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from workflows.cli.main import main
from decoder.engines.vllm.env import SETUP, venv_dir, venv_python
from workflows.export.vllm import run_engine, suffix_available

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "reports" / "example-autotune-cpu-smollm2-135m"
REQUIRED = os.environ.get("TREE_PLANNER_REQUIRE_VLLM") == "1"
PYTHON = venv_python()
WRONG = "a misspelt key (the check must be able to fail)"
# vLLM's mtp drafts with the target's own multi-token-prediction layers, which SmolLM2 (Llama) lacks:
# its export is checked against a config-only DeepSeek-V3-style target with one MTP layer.
MTP_TARGET = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_nextn_predict_layers": 1,
              "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1024, "n_routed_experts": 4,
              "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 64,
              "q_lora_rank": 64, "qk_rope_head_dim": 16, "v_head_dim": 32, "qk_nope_head_dim": 32,
              "max_position_embeddings": 2048}

if PYTHON is None:
    reason = f"the vLLM environment {venv_dir()} is not set up (bash {SETUP})"
    if REQUIRED:
        pytest.fail(f"TREE_PLANNER_REQUIRE_VLLM=1 but {reason}", pytrace=False)
    pytestmark = pytest.mark.skip(reason=reason)


def _drafter_dirs(d: Path, smollm2: Path) -> dict[str, Path]:
    """Config-only folders for the methods vLLM builds from a config.json: an EAGLE head (one Llama
    layer of the target's width), Medusa heads, and a target with an MTP layer."""
    base = json.loads((smollm2 / "config.json").read_text())
    configs = {
        "eagle": dict(base, num_hidden_layers=1),
        "medusa": {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": base["hidden_size"],
                   "vocab_size": base["vocab_size"], "num_heads": 5, "num_hidden_layers": 1},
        "mtp_target": MTP_TARGET,
    }
    out = {}
    for name, cfg in configs.items():
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps(cfg))
        out[name] = d / name
    return out


def _export(tmp: Path, name: str, plan: Path, *extra) -> dict:
    out = tmp / f"{name}.json"
    assert main(["export", "--engine", "vllm", str(plan), "-q", "-o", str(out), *map(str, extra)]) == 0
    return json.loads(out.read_text())["speculative_config"]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from decoder.engines.shipped import model_dir  # the project's converted SmolLM2 (Hugging Face form, cached)

    return model_dir("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, smollm2) -> tuple[dict[str, dict], dict[str, str]]:
    """Every kind of vLLM export, written by `planner export` from the project's own plans, and the
    target folder of those not checked against SmolLM2."""
    tmp = tmp_path_factory.mktemp("vllm-exports")
    drafters = _drafter_dirs(tmp, smollm2)
    batched = ROOT / "exports" / "smollm2-draft-medusa-batched.json"  # a plan with a batch-size schedule
    medusa = ROOT / "trees" / "medusa-vicuna-7b-n63.json"
    out = {
        "ngram (static lookup chain)": _export(tmp, "ngram", RUN / "trees" / "lookup-chain-5.json"),
        "suffix (the main job's per-step plan)": _export(tmp, "suffix", RUN / "chosen.json"),
        "ngram per batch size": _export(tmp, "ngram-batched", batched, "--method", "ngram"),
        "draft_model per batch size": _export(tmp, "draft", batched, "--method", "draft_model",
                                              "--draft-model", smollm2),
        "eagle": _export(tmp, "eagle", medusa, "--method", "eagle", "--draft-model", drafters["eagle"]),
        "eagle3": _export(tmp, "eagle3", medusa, "--method", "eagle3", "--draft-model", drafters["eagle"]),
        "medusa": _export(tmp, "medusa", medusa, "--method", "medusa", "--draft-model", drafters["medusa"]),
        "mtp": _export(tmp, "mtp", medusa, "--method", "mtp"),
    }
    from planner.export import ENGINE_METHODS

    assert {cfg["method"] for cfg in out.values()} == set(ENGINE_METHODS["vllm"]), "a vLLM method without an export"
    return out, {"mtp": str(drafters["mtp_target"])}


@pytest.fixture(scope="module")
def checked(exports, smollm2) -> dict:
    """vLLM's verdict on every export, and on one misspelt config (the check must be able to fail)."""
    configs, targets = exports
    checks = dict(configs, **{WRONG: {"method": "ngram", "num_speculative_tokens": 2, "lookup_max": 3}})
    return run_engine("check", {"model": str(smollm2), "configs": checks, "targets": targets})


def test_every_export_kind_builds_in_vllm(checked, exports):
    checked = dict(checked)
    wrong = checked.pop(WRONG)
    assert wrong and "lookup_max" in wrong  # vLLM's config class refuses what it does not know
    assert set(checked) == set(exports[0])
    suffix_missing = not suffix_available(PYTHON)
    rejected = {k: v for k, v in checked.items() if v is not None and not (suffix_missing and "suffix" in k)}
    assert not rejected, rejected
    if suffix_missing:
        _missing("suffix exports unchecked")


def _missing(what: str):
    msg = f"{what}: arctic-inference is not installed in the vLLM environment (re-run bash {SETUP})"
    if REQUIRED:
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


SHIPPED_HEAD = ROOT / "models" / "smollm2-135m" / "eagle3"


def test_vllm_runs_the_shipped_head_as_this_project_does(smollm2):
    """The EAGLE-3 head shipped for SmolLM2, loaded by vLLM as any released head (method eagle3): greedy answers
    equal vLLM plain's, and its accepted drafts match this project's own EAGLE-3 arithmetic on the same
    prompts (decoder/torch_ops/eagle.py: the same head drafting the same chains accepts the same tokens, up to
    fp32 rounding near ties)."""
    import torch

    from decoder import api
    from decoder.guessers.draft import DraftModelGuesser
    from decoder.guessers.heads import open_eagle
    from decoder.loop import generate

    engine = api.open_engine("hf", model="smollm2-135m", threads=1)
    questions = ["Explain how a rainbow forms.", "Give me three tips for growing tomatoes.",
                 "Rewrite politely: send me the report by noon."]
    ids = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                tokenize=True) for q in questions]
    ids = [list(map(int, p["input_ids"] if hasattr(p, "keys") else p)) for p in ids]
    g = DraftModelGuesser(open_eagle(str(SHIPPED_HEAD), engine), top_k=4, depth=3)
    ours = [generate(engine, torch.tensor(p), None, g, max_new_tokens=32) for p in ids]
    cfg = {"method": "eagle3", "model": str(SHIPPED_HEAD), "num_speculative_tokens": 3}
    spec = run_engine("decode", {"model": str(smollm2), "config": cfg, "max_tokens": 32, "prompts": ids, "warmup": ids[0]})
    plain = run_engine("decode", {"model": str(smollm2), "config": None, "max_tokens": 32, "prompts": ids,
                                  "warmup": ids[0]})
    assert spec["tokens"] == plain["tokens"]  # vLLM's EAGLE-3 path keeps plain's greedy answers
    assert [o.tokens.tolist() for o in ours] == plain["tokens"]  # and this project's equal them too (fp32)
    accepted = sum(sum(o.stats.accepted) for o in ours)
    assert spec["accepted"] > 0 and abs(spec["accepted"] - accepted) <= max(2, 0.05 * accepted), (spec, accepted)
