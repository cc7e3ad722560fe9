"""What every benchmark shares: the machine it ran on, the load it tolerates, its prompts, its timing
loop and the end of its `main`.

    from common import bench_main, machine, bench_ids, interleaved, geomean, by_group, Results

Machine: CPU name, vector extensions, cores and the load average come from profiler/machine.py (one
home: no benchmark reads /proc/cpuinfo or os.getloadavg itself), torch's threads and version beside.

Load: a timing says as much about another process sharing the cores as about the code timed, so a
benchmark run by `bench_main` refuses to write its results when the 1-minute load average is above
LOAD_LIMIT at the start, or when other processes used more than LOAD_LIMIT cores between two samples
during the run (`sample_load`, called by `interleaved` after every prompt; during the run the load
average would count the benchmark's own threads, so the meter counts the machine's busy time less this
process's and its children's). Refused in one line on stderr, exit code 3, nothing written, unless
--loaded-ok says the load is intended; every JSON result records what was seen ("load_watch").

Prompts come from training.splits.bench_prompts: hand-written chats asked alone ("single") or as two turns
("chat": the follow-up is timed), and requests
that repeat their input ("repeat": rewrite, summarise, edit, extract), which no tuning step reads
(no drafter trained on them, no acceptance was measured on them, no plan raced on them;
tests/test_splits.py checks it). A two-turn chat is the model's own greedy answer to the first turn
(the engine's stock generation) followed by the second turn: the benchmark decodes the answer to the
second. Results are reported per group as well as over all prompts.

Timing: every contender runs once first (warm-up: the first call at a shape costs many times a
warm one), then per prompt and repeat the contenders run in a shuffled order, so a slow spell of
the machine spreads over all of them; per prompt the median over repeats; speedups are per-prompt
ratios against a baseline measured in the same run, summarised by their geometric mean.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from planner.errors import UserError  # noqa: E402
from profiler.machine import cores, cpu_name, load_avg, load_avgs, vector_extensions  # noqa: E402

MAX_PROMPTS = 64  # per group: bounds what a user can type
LOAD_LIMIT = 0.5  # load (runnable processes, or cores others keep busy) above which the cores are shared
LOADED_EXIT = 3  # the exit code of a run refused for the load (2: any other one-line error)


def load() -> list[float]:
    """The load average over 1, 5 and 15 minutes (empty where the OS has none)."""
    return load_avgs()


def machine() -> dict:
    """The machine a result was measured on: CPU model and vector extensions, cores, torch threads and
    version, load now."""
    return {"cpu": cpu_name(), "vector_extensions": vector_extensions(), "cores": cores(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "load_avg": load_avgs()}


# ------------------------------------------------------------------ the machine's load


class MachineLoaded(UserError):
    """Another process shared the cores: the run's timings would measure it too."""

    exit_code = LOADED_EXIT


def _children_s() -> float:
    """CPU seconds of this process's finished children (a `planner decode`, a vLLM engine process)."""
    t = os.times()
    return t.children_user + t.children_system


class OthersMeter:
    """Cores other processes used since the last lap: profiler/load.py's meter (the machine's busy time
    less this process's own, all threads) less this process's finished children, which a benchmark runs
    itself. Not the load average: that counts the benchmark's own threads (2 on a 2-core machine)."""

    def __init__(self) -> None:
        self._start()

    def _start(self) -> None:
        from profiler.load import OtherLoad

        self.meter = OtherLoad()
        self.meter.start()
        self.t0, self.children0 = time.perf_counter(), _children_s()

    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def lap(self) -> float | None:
        others, wall, children = self.meter.stop(), self.seconds(), _children_s() - self.children0
        self._start()
        if others is None or wall <= 0:  # no /proc/stat: unknown
            return None
        return round(max(0.0, others - children / wall), 2)


MIN_LAP_S = 2.0  # /proc/stat counts in 10 ms ticks: a shorter lap is mostly rounding


@dataclass
class LoadWatch:
    """The load one run saw: the 1-minute load average at the start (before the run adds its own), then
    the cores other processes used between samples. allowed (--loaded-ok): the load is intended, so a
    high one is recorded, not refused."""

    allowed: bool = False
    limit: float = LOAD_LIMIT
    load_avg_start: float | None = None
    others: list[float] = field(default_factory=list)  # cores other processes used, per lap
    meter: OthersMeter | None = None

    def start(self) -> None:
        self.load_avg_start = load_avg()
        self.meter = OthersMeter()
        if self.load_avg_start is not None and self.load_avg_start > self.limit:
            self._refuse(f"load average {self.load_avg_start} above {self.limit} at the start")

    def sample(self, final: bool = False) -> None:
        """A lap of the meter (at least MIN_LAP_S long, or whatever is left at the end); refuses above the limit."""
        if self.meter is None or self.meter.seconds() < (0.2 if final else MIN_LAP_S):
            return
        x = self.meter.lap()
        if x is None:
            return
        self.others.append(x)
        if x > self.limit:
            self._refuse(f"other processes used {x} cores (limit {self.limit}) during the run")

    def _refuse(self, what: str) -> None:
        if self.allowed:
            return
        seen = f" (other processes' cores per sample: {self.others})" if len(self.others) > 1 else ""
        raise MachineLoaded(f"refused: {what}{seen}, so nothing is written; rerun on a quiet machine, or pass "
                            "--loaded-ok if the load is intended")

    def record(self) -> dict:
        return {"load_avg_1m_start": self.load_avg_start, "other_cores": list(self.others),
                "load_avg_1m_now": load_avg(), "limit": self.limit, "loaded_ok": self.allowed}


# library use (tests, one benchmark importing another) refuses nothing: bench_main starts a real watch
_WATCH = [LoadWatch(allowed=True)]


def watch_load(allowed: bool) -> LoadWatch:
    """A new watch for this run, started now: a machine loaded at the start is refused before any work."""
    _WATCH[0] = LoadWatch(allowed=allowed)
    _WATCH[0].start()
    return _WATCH[0]


def sample_load() -> None:
    """One sample of the current run's watch (after each prompt, repeat or round); refuses above the limit."""
    _WATCH[0].sample()


def load_record() -> dict:
    """The load seen so far in this run, for a result file."""
    return _WATCH[0].record()


# ------------------------------------------------------------------ results and the end of main


@dataclass
class Results:
    """What a benchmark run produced: files to write (path -> a JSON object, text or bytes), the summary
    to print, and the exit code. JSON objects get the run's load_watch."""

    files: dict = field(default_factory=dict)
    summary: str = ""
    code: int = 0


def write_results(results: Results) -> list[Path]:
    """Write every file atomically, after one more load sample: a run that ended loaded writes nothing."""
    from planner.jsonio import atomic_write_bytes

    _WATCH[0].sample(final=True)
    written = []
    for path, content in results.files.items():
        if isinstance(content, dict):
            content = json.dumps(content | {"load_watch": load_record()}, indent=1, allow_nan=False, default=str) + "\n"
        written.append(atomic_write_bytes(path, content.encode() if isinstance(content, str) else content))
    return written


def add_loaded_ok(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--loaded-ok", action="store_true",
                        help=f"write results even when the 1-minute load average is above {LOAD_LIMIT} (the load is "
                             "intended; the result file records the loads seen)")


def bench_main(name: str, parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], Results],
               argv: list[str] | None = None, writes: Callable[[argparse.Namespace], bool] = lambda a: True) -> int:
    """The end of every benchmark's main: parse the arguments (plus --loaded-ok), watch the load from
    the start when the run writes results (`writes`) and is not --smoke, run, write the results and
    print the summary.
    A UserError (a bad argument, a refused load) is one line on stderr: exit code 2, or 3 for the load."""
    add_loaded_ok(parser)
    args = parser.parse_args(argv)
    try:
        # a smoke run checks code paths on a toy model: its numbers mean nothing, so no load refuses it
        watch_load(args.loaded_ok or getattr(args, "smoke", False) or not writes(args))
        results = run(args)
        written = write_results(results)
    except UserError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    finally:  # the watch is this run's: code that runs after it (a test, another benchmark) is not refused
        _WATCH[0] = LoadWatch(allowed=True)
    if written:
        print(f"{name}: wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    if results.summary:
        print(results.summary)
    return results.code


# ------------------------------------------------------------------ prompts


@dataclass
class BenchIds:
    """One benchmark prompt as token ids, ready to decode."""

    id: str
    group: str  # single | chat | repeat (training.splits.GROUPS)
    ids: torch.Tensor  # [T]


def open_hf(model: str, dtype: str | None = None, threads: int | None = None, device: str = "cpu"):
    """The hf engine on `model` (a registry model, builtin, a preset: random weights), on the CPU by default."""
    from decoder.engines.registry import EngineRequest, open_engine

    return open_engine("hf", EngineRequest(model=model, device=device, dtype=dtype, threads=threads))


def builtin_tokenizer():
    """The built-in model's tokenizer: smoke runs on a tiny random model of the same 4096-token
    vocabulary encode the benchmark prompts with it."""
    return open_hf("builtin").tokenizer


def tokenizer_or_builtin(engine):
    """The engine's tokenizer, or the built-in model's for a random-weight preset (same vocabulary: tiny)."""
    return engine.tokenizer if engine.tokenizer is not None else builtin_tokenizer()


def encode_chat(tokenizer, messages: list[dict]) -> torch.Tensor:
    """Messages [{role, content}] up to the assistant's next turn: the model's chat template, or the
    "USER: ... ASSISTANT: ..." format the built-in model was trained on (workflows.cli.inputs)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    text = " ".join(f"{m['role'].upper()}: {m['content'].strip()}" for m in messages) + " ASSISTANT:"
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return torch.tensor(bos + tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def bench_ids(tokenizer, counts: dict[str, int], engine=None, first_answer_tokens: int = 64,
              keep_last: int | None = None) -> list[BenchIds]:
    """counts {group: n} of training.splits.bench_prompts, encoded; a chat's first turn is answered
    by the engine's own greedy generation (engine.stock_generate, first_answer_tokens) before its second
    turn is asked. keep_last: only the last that many ids (smoke runs on tiny models, which check code
    paths, not speed)."""
    from training.splits import bench_prompts

    out = []
    for group, n in counts.items():
        if not 0 <= n <= MAX_PROMPTS:
            raise UserError(f"--{group}-prompts: expected 0..{MAX_PROMPTS}, got {n}")
        for p in bench_prompts(group, n):
            messages = [{"role": "user", "content": p.turns[0]}]
            for turn in p.turns[1:]:
                if engine is None:
                    raise UserError(f"prompt {p.id}: a two-turn chat needs the model to answer its first turn")
                answer, _ = engine.stock_generate(encode_chat(tokenizer, messages), first_answer_tokens)
                reply = tokenizer.decode(answer, skip_special_tokens=True)
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": turn}]
            ids = encode_chat(tokenizer, messages)
            out.append(BenchIds(p.id, group, ids if keep_last is None else ids[-keep_last:]))
    return out


# ------------------------------------------------------------------ what the engine's stock generation lacks


@torch.inference_mode()
def library_generate(engine, ids: torch.Tensor, max_new_tokens: int, paths: bool = False, **options) -> list[int]:
    """transformers' own greedy `generate` with options the engine's stock_generate does not take: its own
    speculation (prompt_lookup_num_tokens=K, assistant_model=draft). On stock F.linear unless paths=True
    (bench_cpu_paths: the engine's installed CPU matmul paths under generate itself). The one place a
    benchmark calls the torch model's generate (docs/benchmarks.md: engine gaps)."""
    from decoder.engines.hf.cpu_paths import set_paths_enabled

    model = engine.torch_model()
    eos = sorted(engine.eos_ids()) or None
    set_paths_enabled(model, paths)
    try:
        out = model.generate(ids.reshape(1, -1).to(engine.device), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=0, eos_token_id=eos, pad_token_id=(eos or [0])[0], **options)
    finally:
        set_paths_enabled(model, True)
    return out[0, ids.numel():].tolist()


# the trained draft LM these benchmarks measured no longer ships: it lost to plain everywhere and the
# EAGLE-3 head took its place in the repository's 40 MB (docs/heads.md)
DRAFT_LM_GONE = ("no draft LM ships for SmolLM2 any more (the EAGLE-3 head replaced it, docs/heads.md): train one with "
                 "`planner train-drafter --kind draft-lm --layers 2 --out DIR` and give --draft DIR, or --draft first-layers:N")


def drafter(spec: str | None, engine):
    """A draft LM on the engine's torch model (it shares the target's embedding and head): a directory
    (a draft LM trained by `planner train-drafter --kind draft-lm`, or a Hugging Face model of the same
    vocabulary) or first-layers:N (the target's first N layers, untrained)."""
    from pathlib import Path

    from decoder.torch_ops.draft_lm import build_draft_lm, load_draft_model

    if spec is None or not (spec.startswith("first-layers:") or Path(spec).is_dir()):
        raise UserError(DRAFT_LM_GONE if spec is None else f"--draft {spec}: not a directory; " + DRAFT_LM_GONE)
    target = engine.torch_model()
    if not spec.startswith("first-layers:"):
        return load_draft_model(spec, target)
    try:
        n = int(spec.split(":", 1)[1])
    except ValueError:
        raise UserError(f"--draft {spec}: expected first-layers:N with N an integer") from None
    if n < 1:
        raise UserError(f"--draft {spec}: N must be at least 1")
    try:
        return build_draft_lm(target, n)
    except IndexError:  # the target has fewer layers than N
        raise UserError(f"--draft {spec}: N must be below the target's number of layers") from None


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
    shuffled order. After every item the load is sampled (`sample_load`: a run that turned loaded
    stops there), then on_item(timings, k) (a benchmark writes what is done, so Ctrl-C keeps it)."""
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
        sample_load()
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
