"""Timers inside a served vLLM's processes, for bench/serving_probe.py (not a plugin; nothing ships).

Python imports `sitecustomize` at start-up from the path; bench/serving_probe.py puts this folder on the
servers' PYTHONPATH with TREE_PLANNER_PROBE=DIR. Without that variable this file does nothing. With it,
an import hook wraps vLLM 0.32's classes as their modules load (before any engine is built, so the
engine core's bound `step_fn` is the timed one) and each process appends its records to
DIR/<process group>-<pid>.jsonl:

- engine core, one row per loop turn: ["loop", t, wait_s, step_s, schedule_s, update_s, post_s, reqs,
  tokens, drafts]: `wait_s` the time in _process_input_queue (blocked for work, or taking requests in),
  `step_s` the rest of the turn (schedule, the worker's forward, update_from_output, the output put,
  post_step), `reqs`/`tokens`/`drafts` what the step scheduled;
- API server, one row per engine-output batch: ["out", t, process_s, outputs] (OutputProcessor:
  detokenize, build the responses) and one per request taken in: ["in", t, add_s].

The first line names the process: its role, its process group (the server: `vllm serve` leads a session
of its own) and the leader's command line (its --speculative-config). The timers cost a few perf_counter
calls per step of ~50-200 ms and a\nthread that wakes twice a second.
"""
from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time

DIR = os.environ.get("TREE_PLANNER_PROBE", "")
FLUSH_S = 0.5  # a thread writes the rows this often: vLLM's processes end by signal, past atexit


class _Log:
    def __init__(self, role: str):
        self.role, self.rows, self.path = role, [], None

    def add(self, row: list) -> None:
        self.rows.append(row)

    def flush(self) -> None:
        if not self.rows:
            return
        if self.path is None:
            pgid = os.getpgid(0)
            self.path = os.path.join(DIR, f"{pgid}-{os.getpid()}.jsonl")
            try:
                with open(f"/proc/{pgid}/cmdline", "rb") as f:
                    leader = [a.decode() for a in f.read().split(b"\0") if a]
            except OSError:
                leader = []
            head = {"role": self.role, "pgid": pgid, "pid": os.getpid(), "leader": leader,
                    "plugin": os.environ.get("TREE_PLANNER_VLLM_PLUGIN", "")}
            with open(self.path, "a") as f:
                f.write(json.dumps(head) + "\n")
        rows, self.rows = self.rows, []
        with open(self.path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))


_logs: dict[str, _Log] = {}


def _log(role: str) -> _Log:
    if role not in _logs:
        log = _logs[role] = _Log(role)
        atexit.register(log.flush)
        threading.Thread(target=_flush_forever, args=(log,), daemon=True, name="tree-planner-probe").start()
    return _logs[role]


def _flush_forever(log: _Log) -> None:
    while True:
        time.sleep(FLUSH_S)
        log.flush()


def _patch_scheduler(module) -> None:
    cls = module.Scheduler
    schedule, update = cls.schedule, cls.update_from_output

    def timed_schedule(self, *args, **kwargs):
        t = time.perf_counter()
        out = schedule(self, *args, **kwargs)
        self._probe_schedule = (time.perf_counter() - t, len(out.num_scheduled_tokens), out.total_num_scheduled_tokens,
                                sum(len(d) for d in out.scheduled_spec_decode_tokens.values()))
        return out

    def timed_update(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return update(self, *args, **kwargs)
        finally:
            self._probe_update = time.perf_counter() - t

    cls.schedule, cls.update_from_output = timed_schedule, timed_update


def _patch_core(module) -> None:
    core_cls, proc_cls = module.EngineCore, module.EngineCoreProc
    wait, step, post = proc_cls._process_input_queue, proc_cls._process_engine_step, core_cls.post_step

    def timed_wait(self):
        t = time.perf_counter()
        wait(self)
        self._probe_wait = (t, time.perf_counter() - t)

    def timed_post(self, model_executed):
        t = time.perf_counter()
        try:
            return post(self, model_executed)
        finally:
            self._probe_post = time.perf_counter() - t

    def timed_step(self):
        sched = self.scheduler
        sched._probe_schedule, sched._probe_update, self._probe_post = (0.0, 0, 0, 0), 0.0, 0.0
        t = time.perf_counter()
        try:
            return step(self)
        finally:
            t_wait, wait_s = getattr(self, "_probe_wait", (t, 0.0))
            schedule_s, reqs, tokens, drafts = sched._probe_schedule
            _log("engine").add(["loop", round(t_wait, 6), round(wait_s, 6), round(time.perf_counter() - t, 6),
                                round(schedule_s, 6), round(sched._probe_update, 6), round(self._probe_post, 6),
                                reqs, tokens, drafts])

    proc_cls._process_input_queue, proc_cls._process_engine_step, core_cls.post_step = timed_wait, timed_step, timed_post


def _patch_output_processor(module) -> None:
    cls = module.OutputProcessor
    process, add = cls.process_outputs, cls.add_request

    def timed_process(self, engine_core_outputs, *args, **kwargs):
        t = time.perf_counter()
        try:
            return process(self, engine_core_outputs, *args, **kwargs)
        finally:
            _log("api").add(["out", round(t, 6), round(time.perf_counter() - t, 6), len(engine_core_outputs)])

    def timed_add(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return add(self, *args, **kwargs)
        finally:
            _log("api").add(["in", round(t, 6), round(time.perf_counter() - t, 6)])

    cls.process_outputs, cls.add_request = timed_process, timed_add


PATCHES = {"vllm.v1.core.sched.scheduler": _patch_scheduler, "vllm.v1.engine.core": _patch_core,
           "vllm.v1.engine.output_processor": _patch_output_processor}


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the target modules' classes right after the module body runs."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


if DIR:
    sys.meta_path.insert(0, _Finder())
