"""The project's side of vLLM: run workflows/export/vllm_inside.py inside the vLLM environment
(scripts/setup_vllm.sh; decoder/engines/vllm/env.py finds it) on a request, read the result. Used by `planner export --race`,
tests/test_vllm.py and bench/bench_vllm.py; nothing here imports vLLM.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from decoder.engines.vllm.env import require_python
from planner.errors import UserError
from planner.vllm_plugin import PLUGIN_ENV, needs_plugin

ROOT = Path(__file__).resolve().parents[2]


def suffix_available(python: Path) -> bool:
    """Whether suffix decoding's index (arctic-inference) is installed beside vLLM."""
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('arctic_inference') is None)"
    return subprocess.run([str(python), "-c", code], capture_output=True, check=False).returncode == 0


def run_engine(mode: str, request: dict, timeout_s: float = 900, log=None, plugin: bool = False) -> dict:
    """One process of workflows/export/vllm_inside.py in the vLLM environment; its result. A failure is a
    UserError carrying the last line vLLM printed. `log`: a file object for vLLM's own output
    (default: kept only to report a failure). `plugin`: the project's vLLM plugin switched on in it
    (off otherwise, whatever the caller's environment says)."""
    python = require_python()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **{PLUGIN_ENV: "1" if plugin else "0"})
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with tempfile.TemporaryDirectory(prefix="tree-planner-vllm-") as d:
        req, res = Path(d) / "request.json", Path(d) / "result.json"
        req.write_text(json.dumps(request))
        try:
            proc = subprocess.run([str(python), "-m", "workflows.export.vllm_inside", mode, str(req), str(res)], env=env, check=False,
                                  cwd=str(ROOT), stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT if log is None
                                  else log, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise UserError(f"vLLM ({mode}) did not finish within {timeout_s:.0f} s") from None
        if proc.returncode != 0 or not res.is_file():
            tail = [ln for ln in (proc.stdout or "").splitlines() if ln.strip()][-1:] or ["(see the log)"]
            raise UserError(f"vLLM ({mode}) failed with exit code {proc.returncode}: {tail[0].strip()[:300]}")
        return json.loads(res.read_text())


def decode_request(model_dir: str, config: dict | None, prompts: list[list[int]], warmup: list[int],
                   max_tokens: int, batched: bool = False) -> dict:
    return {"model": str(model_dir), "config": config, "prompts": [list(map(int, p)) for p in prompts],
            "warmup": list(map(int, warmup)), "max_tokens": int(max_tokens), "batched": batched}


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- the race

RACE_DEFAULTS = {  # vLLM's own settings, raced beside the planned ones
    "vLLM ngram (docs example)": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4},
    "vLLM suffix (defaults)": {"method": "suffix"},
}


def race_prompts(model: str, n: int) -> tuple[str, list[list[int]], list[int]]:
    """(model folder, the race split's first n prompts as token ids, a warm-up prompt): the held-out
    questions autotune races on (training.splits.accept_and_race), through the chat template."""
    from decoder.engines.hf.tokenizer import load_tokenizer
    from decoder.engines.shipped import model_dir
    from training.splits import accept_and_race
    from workflows.cli.inputs import DEFAULT_QUESTIONS, encode_prompts

    folder = str(model_dir(model, progress=False)) if not Path(model).is_dir() else model
    accept, race = accept_and_race(DEFAULT_QUESTIONS, 1, n)
    ids = [t.tolist() for t in encode_prompts(load_tokenizer(folder), accept + race)]
    return folder, ids[1:], ids[0]


def race(model_dir: str, configs: dict, prompts: list[list[int]], warmup: list[int], max_tokens: int,
         plugin: bool = True) -> dict:
    """Every config (None: plain) in its own engine, one after another, on the same prompts, each with the
    project's vLLM plugin where it needs it (`plugin`, planner.export.needs_plugin): name -> {"tokens_per_s",
    "identical" (to plain), "drafted", "accepted"} or {"error"}."""
    out, plain_tokens = {}, None
    for name, cfg in configs.items():
        progress(f"race: {name} ...")
        try:
            r = run_engine("decode", decode_request(model_dir, cfg, prompts, warmup, max_tokens),
                           plugin=plugin and needs_plugin(cfg))
        except UserError as e:
            out[name] = {"error": str(e)}
            continue
        plain_tokens = r["tokens"] if cfg is None else plain_tokens
        out[name] = {"tokens_per_s": sum(map(len, r["tokens"])) / sum(r["seconds"]), "tokens": r["tokens"],
                     "drafted": r["drafted"], "accepted": r["accepted"]}
        progress(f"race: {name}: {out[name]['tokens_per_s']:.1f} tokens/s")
    for row in out.values():
        if "tokens" in row:
            row["identical"] = plain_tokens is None or row.pop("tokens") == plain_tokens
    return out
