"""A plan as a llama-server command line (numpy only): `planner export --engine llama-server --plan PLAN`.

The flags are those of the llama-server built from the llama.cpp that llama-cpp-python 0.3.36 vendors
(scripts/build_llama_server.sh), read from its `--help` and common/arg.cpp:
  -m FILE, -t N, -tb N, -c N, -np N, -fa on|off|auto, --host, --port
  --spec-type TYPE[,TYPE]            none, draft-simple, ngram-simple, ngram-map-k, ngram-mod, ngram-cache, ...
  --spec-ngram-simple-size-n N       ngram-simple: the n-gram looked up (exactly N tokens)
  --spec-ngram-simple-size-m M       ngram-simple: the tokens drafted after a match (M)
  --spec-draft-n-max N, --spec-draft-n-min N, --spec-draft-p-min P, -md FILE   draft-model speculation
This build removed --draft-max / --draft-min (--draft, --draft-n, --draft-n-min): passing them is an
error ("the argument has been removed"); --draft-p-min remains an alias of --spec-draft-p-min.

What maps: prompt lookup -> ngram-simple (N, M); a draft model given as a GGUF file -> draft-simple with
n-max, n-min 0 and p-min. A static chain keeps its length; a per-step (dynamic) lookup plan becomes the
smallest n-gram length at which its calibrated first guess pays for the wider step, and the chain
length best for that match (the per-step choice itself is dropped, with a note). The server verifies
one chain per request and runs batch size 1 here (-np 1); flash attention off, as the plan was
profiled. What it cannot express is said in `notes`.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field

import numpy as np

from planner.engines import DEFAULT, kinds
from planner.engines import kind as engine_kind
from planner.errors import UserError
from planner.guessers import PLAIN, names
from planner.guessers import kind as guesser_kind
from planner.tree import DYNAMIC, Tree

LOOKUP_NGRAMS = (1, 2, 3)  # the n-gram sizes our prompt lookup tries (decoder/guessers/lookup.py: 3 down to 1)
STATIC_NGRAM = 3  # a static chain plan has no per-match statistics: guess after a 3-token match
REMOVED_FLAGS = ("--draft", "--draft-n", "--draft-max", "--draft-min", "--draft-n-min")


@dataclass
class ServerExport:
    command: list[str]
    settings: dict
    notes: list[str] = field(default_factory=list)

    @property
    def command_line(self) -> str:
        return shlex.join(self.command)

    def to_json(self) -> dict:
        return {"format": "tree-planner/export", "version": 1, "engine": "llama-server", "server_args": self.command[1:],
                "settings": self.settings, "command_line": self.command_line, "notes": list(self.notes)}


def best_chain(c: np.ndarray, cost: np.ndarray) -> tuple[int, float]:
    """(k, tokens per second relative to a plain step) of the best chain of 0..len(c) guesses, where guess d
    is accepted with conditional probability c[d-1] and a step of k guesses costs cost[k]."""
    reach = np.concatenate([[1.0], np.cumprod(c)])  # P(guesses 1..k all accepted), k = 0..D
    tau = np.cumsum(reach)  # expected tokens of a chain of k: 1 + sum_{d<=k} P(reach d)
    n = min(len(tau), len(cost))
    rate = tau[:n] / cost[:n]
    k = int(np.argmax(rate))
    return k, float(rate[k] * cost[0])


def lookup_settings(plan: Tree) -> tuple[int, int, list[str]]:
    """(N, M, notes) of ngram-simple for a lookup plan."""
    notes = []
    if plan.method != DYNAMIC:
        depth = plan.depth
        notes.append(f"n-gram size: the plan's lookup tries 3- to 1-token matches, ngram-simple exactly N; N = "
                     f"{STATIC_NGRAM} written (a static chain plan has no per-match statistics)")
        return STATIC_NGRAM, depth, notes
    spec = plan.dynamic
    model = spec.guessers.get("lookup")
    if model is None:
        raise UserError("the dynamic plan has no lookup map; llama-server's n-gram speculation needs one")
    cost = np.asarray(spec.step_cost_s, dtype=np.float64)
    D = min(spec.max_depth, len(cost) - 1)
    for n in LOOKUP_NGRAMS:
        if model.calibration is not None:
            from planner.dynamic import lookup_bins

            bins = lookup_bins(np.full(D, n), np.ones(D, dtype=np.int64))  # a first occurrence (follow count 1)
            c = model.calibration.conditional(np.arange(1, D + 1), bins)
        else:
            c = model.prior[:D, 0]
        k, rate = best_chain(np.asarray(c, dtype=np.float64), cost)
        if k > 0 and rate > 1.0:
            notes.append(f"per-step sizing dropped: the plan guesses 0..{spec.max_size} tokens by calibrated confidence "
                         f"every step; ngram-simple drafts {k} after every {n}-token match (the smallest match at which "
                         f"its map predicts a guess pays, {rate:.2f}x a plain step)")
            return n, k, notes
    raise UserError("plain decoding is predicted fastest at every n-gram match length: llama-server needs no "
                    "speculative flags (export without them, or decode plainly)")


SERVER = "llama-server"  # the serving program this export writes for (an engine kind lists it in `serves`)


def llama_server_export(plan: Tree, model_file: str, threads: int, n_ctx: int = 4096, host: str = "127.0.0.1",
                        port: int = 8080, draft_model: str | None = None, draft_p_min: float | None = None) -> ServerExport:
    if not 1 <= threads <= 256 or not 256 <= n_ctx <= 131072 or not 1 <= port <= 65535:
        raise UserError("--threads in 1..256, --n-ctx in 256..131072, --port in 1..65535")
    kind = plan.settings.get("guesser", PLAIN)
    base = ["llama-server", "-m", model_file, "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-np", "1",
            "-fa", "off", "--host", host, "--port", str(port)]
    notes = []
    made_for = engine_kind(plan.engine or DEFAULT)
    if SERVER not in made_for.serves:
        served_by = next((k.name for k in kinds() if SERVER in k.serves), "?")
        notes.append(f"the plan was made for the {made_for.name} engine: its profile timed another engine, so the draft "
                     f"lengths are that engine's; plan from `planner profile --engine {served_by}` for {SERVER}")
    if "+" in kind:
        notes.append(f"hybrid dropped: llama-server runs one speculative method per request; {kind} is written as its "
                     f"{kind.split('+')[0]} part")
        kind = kind.split("+")[0]
    if any(len(st.nodes) != st.depth for st in plan.states):
        notes.append("tree dropped: llama-server verifies one chain; the plan's first path (its depth) is written")
    if kind == PLAIN or (not any(st.nodes for st in plan.states) and plan.method != DYNAMIC):
        return ServerExport(base, {"speculative": None}, notes + ["plain decoding: the plan chose no speculation, so "
                                                                  "no --spec-* flags"])
    export = guesser_kind(kind).export if kind in names() else None
    if export == "ngram":
        n, m, more = lookup_settings(plan)
        flags = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(n), "--spec-ngram-simple-size-m", str(m)]
        return ServerExport(base + flags, {"speculative": "ngram-simple", "size_n": n, "size_m": m}, notes + more)
    if export == "draft_model":
        if not draft_model:
            raise UserError(f"--draft-model FILE.gguf: llama-server drafts with a GGUF model; the plan's {kind} drafter "
                            "is a torch model (convert it, then give its GGUF)")
        k = plan.depth if plan.method != DYNAMIC else plan.dynamic.max_depth
        p_min = 0.0 if draft_p_min is None else float(draft_p_min)
        if not 0.0 <= p_min <= 1.0:
            raise UserError(f"--draft-p-min: expected a probability in [0, 1], got {p_min}")
        if plan.method == DYNAMIC:
            notes.append("per-step sizing dropped: draft-simple drafts up to n-max and stops below p-min")
        flags = ["--spec-type", "draft-simple", "-md", draft_model, "--spec-draft-n-max", str(k),
                 "--spec-draft-n-min", "0", "--spec-draft-p-min", f"{p_min:g}"]
        return ServerExport(base + flags, {"speculative": "draft-simple", "n_max": k, "n_min": 0, "p_min": p_min},
                            notes)
    raise UserError(f"the plan's guesser {kind!r} has no llama-server method (it has n-gram lookup and draft models)")
