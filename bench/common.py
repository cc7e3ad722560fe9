"""What every benchmark shares: the machine it ran on, its prompts, and its timing loop.

    from common import machine, bench_ids, interleaved, geomean, by_group

Prompts come from training.splits.bench_prompts: hand-written two-turn chats ("chat") and requests
that repeat their input ("repeat": rewrite, summarise, edit, extract), which no tuning step reads
(no drafter trained on them, no acceptance was measured on them, no plan raced on them;
tests/test_splits.py checks it). A two-turn chat is the model's own greedy answer to the first turn
followed by the second turn: the benchmark decodes the answer to the second. Results are reported
per group as well as over all prompts.

Timing: every contender runs once first (warm-up: the first call at a shape costs many times a
warm one), then per prompt and repeat the contenders run in a shuffled order, so a slow spell of
the machine spreads over all of them; per prompt the median over repeats; speedups are per-prompt
ratios against a baseline measured in the same run, summarised by their geometric mean.
"""
from __future__ import annotations

import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

GROUPS = ("chat", "repeat")
MAX_PROMPTS = 64  # per group: bounds what a user can type


def load() -> list[float]:
    """The load average over 1, 5 and 15 minutes (empty where the OS has none)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def machine() -> dict:
    """The machine a result was measured on: CPU model, cores, torch threads and version, load now."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "load_avg": load()}


# ------------------------------------------------------------------ prompts


@dataclass
class BenchIds:
    """One benchmark prompt as token ids, ready to decode."""

    id: str
    group: str  # chat | repeat
    ids: torch.Tensor  # [T]


def builtin_tokenizer():
    """The built-in model's tokenizer: smoke runs on a tiny random model of the same 4096-token
    vocabulary encode the benchmark prompts with it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "models" / "builtin")


def encode_chat(tokenizer, messages: list[dict]) -> torch.Tensor:
    """Messages [{role, content}] up to the assistant's next turn: the model's chat template, or the
    "USER: ... ASSISTANT: ..." format the built-in model was trained on (workflows.cli.inputs)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    text = " ".join(f"{m['role'].upper()}: {m['content'].strip()}" for m in messages) + " ASSISTANT:"
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return torch.tensor(bos + tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


@torch.inference_mode()
def bench_ids(tokenizer, counts: dict[str, int], model=None, first_answer_tokens: int = 64,
              keep_last: int | None = None) -> list[BenchIds]:
    """counts {group: n} of training.splits.bench_prompts, encoded; a chat's first turn is answered
    by `model` greedily (first_answer_tokens) before its second turn is asked. keep_last: only the
    last that many ids (smoke runs on tiny models, which check code paths, not speed)."""
    from planner.errors import UserError
    from training.splits import bench_prompts

    out = []
    for group, n in counts.items():
        if not 0 <= n <= MAX_PROMPTS:
            raise UserError(f"--{group}-prompts: expected 0..{MAX_PROMPTS}, got {n}")
        for p in bench_prompts(group, n):
            messages = [{"role": "user", "content": p.turns[0]}]
            for turn in p.turns[1:]:
                if model is None:
                    raise UserError(f"prompt {p.id}: a two-turn chat needs the model to answer its first turn")
                ids = encode_chat(tokenizer, messages)
                dev = model.get_input_embeddings().weight.device
                answer = model.generate(ids[None].to(dev), max_new_tokens=first_answer_tokens, do_sample=False)
                reply = tokenizer.decode(answer[0, ids.numel():], skip_special_tokens=True)
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": turn}]
            ids = encode_chat(tokenizer, messages)
            out.append(BenchIds(p.id, group, ids if keep_last is None else ids[-keep_last:]))
    return out


# ------------------------------------------------------------------ timing


@dataclass
class Timings:
    """Per contender and prompt: wall and process-CPU seconds of every repeat, and the first output."""

    wall: dict = field(default_factory=dict)  # name -> [per prompt [seconds per repeat]]
    cpu: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)  # name -> [per prompt, the first run's return value]

    def median(self, name: str, clock: str = "wall") -> list[float]:
        """Per prompt, the median over repeats."""
        return [statistics.median(t) for t in (self.wall if clock == "wall" else self.cpu)[name]]


def interleaved(runs: dict, items: list, repeats: int, seed: int = 0, warm_up=None, on_item=None,
                progress: bool = True, warm: bool = True) -> Timings:
    """Time runs[name](item) for every item: a warm-up call of each contender first (on warm_up, or
    the first item; warm=False: the caller warmed up), then per item `repeats` rounds, each in a
    shuffled order. on_item(timings, k) after every item (a benchmark writes what is done, so
    Ctrl-C keeps it)."""
    rng = random.Random(seed)
    names = list(runs)
    for name in names if warm else ():
        runs[name](items[0] if warm_up is None else warm_up)
    t = Timings({k: [] for k in names}, {k: [] for k in names}, {k: [] for k in names})
    for k, item in enumerate(items):
        for name in names:
            t.wall[name].append([])
            t.cpu[name].append([])
            t.outputs[name].append(None)
        for _ in range(repeats):
            order = names[:]
            rng.shuffle(order)
            for name in order:
                w0, c0 = time.perf_counter(), time.process_time()
                out = runs[name](item)
                t.wall[name][k].append(time.perf_counter() - w0)
                t.cpu[name][k].append(time.process_time() - c0)
                if t.outputs[name][k] is None:
                    t.outputs[name][k] = out
        if progress:
            print(f"  prompt {k + 1}/{len(items)} timed ({repeats} repeat(s))", file=sys.stderr, flush=True)
        if on_item is not None:
            on_item(t, k)
    return t


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def by_group(values: list[float], groups: list[str]) -> dict[str, float]:
    """Geometric mean of per-prompt values within each group (ratios: speedups)."""
    out: dict[str, list[float]] = {}
    for v, g in zip(values, groups):
        out.setdefault(g, []).append(v)
    return {g: geomean(v) for g, v in out.items()}
