"""Choosing a plan by measurement: a race in two halves, selection then confirmation
(docs/main-job.md, "The race", says why each rule is there).

Selection (the first race prompts): per prompt every running plan decodes once, shuffled, with
plain decoding at both ends and between every PLAIN_EVERY plans; a plan's ratio on the prompt,
r = log(t_plain / t_plan), takes plain's time interpolated (in log, by time) between the plain
runs around it, so a drift cancels to first order. Plans slower than the leader or plain beyond
the noise leave; when time runs short the slower half leaves. The leader has the highest
posterior mean: measured mean shrunk towards the prediction (sd PRIOR_SD, less the common error
in this race of the predictions made the same way: a replayed prediction reproduces the
acceptance prompts' own text and errs with how much more the race's prompts repeat, the cost
model's averages err otherwise, so one pooled offset would favour whichever way erred less). The
prior ranks plans while few prompts are measured; it never enters the test. Plans whose posterior
means lie within TIE of the leader's tie: the cheapest wins the selection, where every plan
decodes one text (greedy, coupled sampling) by the profile's time for the steps it took on that
text (exact counts, where the timings are noisy), else by its predicted step cost.

Confirmation (the other prompts, CONFIRM_PROMPTS of 8, and selection prompts left unused): the
winner and plain decode each prompt in up to PAIRS pairs ordered by a coin flip. The decision is
the sign-flip test over the prompts' mean log-ratios: with no real difference each prompt's sign
is a fair coin given its size, so the p-value is exact at any n, noise and drift, and as it sees
none of the data that chose the winner, P(a plan is chosen | none is faster) <= ALPHA however
many plans raced. The reported speedup is the confirmation's geometric mean (unbiased, not the
maximum of noisy estimates) with the interval that inverts the same test.

Load: each run carries the cores other processes used meanwhile (profiler.load); a comparison
whose runs disagree on the load state does not count (re-measured once), and a parallel plan
(PEARL: two jobs on their own cores) counts only runs on a free machine.
numpy only: tested on simulated races (tests/test_race.py).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from planner.guessers import PLAIN
from workflows.mainjob.signflip import ALPHA, Interval, interval, sign_flip_p

PLAIN_EVERY = 3  # selection: a plain run between every 3 plans (each plan is at most one run from plain)
PAIRS = 2  # confirmation: at most this many randomized (plan, plain) pairs per prompt, per round
CONFIRM_PROMPTS, CONFIRM_SHARE = 6, 0.6  # race prompts kept for the confirmation: 6, or 60 % when more
Z_DROP = 2.0  # a plan leaves when slower than the leader (or plain) by this many standard errors
PRIOR_SD = 0.10  # the prediction's error (log speedup) once its common bias is removed
NOISE_SD = 0.15  # a per-prompt log-ratio's sd before two prompts measured it
NOISE_FLOOR = 0.02  # pooled sds never below this: a few equal prompts do not prove a plan exact
TIE = 0.02  # posterior means this close (log) tie: the cheaper plan wins (Race.tie_costs)
LOADED_CORES = 0.3  # other processes' CPU (cores) above which a run counts as loaded
REPLAYED = -1  # Arm.steps' key for the steps its replay took over the acceptance prompts' text (one text for all)


# ------------------------------------------------------------------ runs and arms


@dataclass(frozen=True)
class Run:
    """One decode in the race."""

    key: str
    prompt: int
    seconds: float
    start: float  # seconds since the race began
    others: float | None = None  # CPU cores other processes used during it (None: unknown)

    @property
    def loaded(self) -> bool:
        return self.others is not None and self.others >= LOADED_CORES


@dataclass
class Arm:
    """One plan in the race (or plain decoding) and what it measured."""

    key: str
    cost: float  # predicted step time relative to plain's (plain 1.0): ties go to the cheaper arm
    predicted_speedup: float = 1.0
    predicted_s: dict[int, float] = field(default_factory=dict)  # prompt -> predicted seconds (budget, ETA)
    parallel: bool = False  # its speed depends on free cores (PEARL): loaded runs do not count
    predicted_by: str = "cost model"  # how predicted_speedup was made: its offset is that way's (Race.offsets)
    seconds: dict[int, float] = field(default_factory=dict)  # prompt -> median seconds of its runs there
    ratios: dict[int, float] = field(default_factory=dict)  # selection: prompt -> log(t_plain / t_arm)
    pairs: list[tuple[int, float]] = field(default_factory=list)  # confirmation: (prompt, log(t_plain / t_arm))
    dropped: str = ""  # why the arm left the race ("" while it runs)
    steps: dict[int, int] = field(default_factory=dict)  # prompt (or REPLAYED) -> its steps there (Race.same_text)
    times: dict[int, list[float]] = field(default_factory=dict, repr=False)
    loaded_runs: int = 0

    @property
    def running(self) -> bool:
        return not self.dropped

    def add_time(self, prompt: int, seconds: float) -> None:
        self.times.setdefault(prompt, []).append(seconds)
        self.seconds[prompt] = statistics.median(self.times[prompt])

    def r(self) -> list[float]:
        return [self.ratios[p] for p in sorted(self.ratios)]

    def mean_r(self) -> float:
        return sum(self.ratios.values()) / len(self.ratios)


def speedup(arm: Arm, plain: Arm | None = None) -> Interval:
    """The arm's selection speedup over plain: its per-prompt paired ratios (plain: 1)."""
    if arm.key == PLAIN:
        return Interval(1.0, 1.0, 1.0, len(arm.seconds))
    return interval(arm.r())


@dataclass(frozen=True)
class Decision:
    choice: str  # an arm's key, or PLAIN
    speedup: Interval  # the chosen arm's confirmed speedup over plain (1.0 for plain)
    reason: str
    p_value: float | None = None  # the confirmation test's (None: no test ran)


# ------------------------------------------------------------------ the race


def _pooled_sd(samples: list[list[float]], default: float = NOISE_SD) -> float:
    """sd pooled over samples of 2 or more values; `default` when none has 2."""
    num = df = 0.0
    for s in samples:
        if len(s) >= 2:
            m = sum(s) / len(s)
            num, df = num + sum((v - m) ** 2 for v in s), df + len(s) - 1
    return max(math.sqrt(num / df), NOISE_FLOOR) if df else default


@dataclass
class Race:
    """Selection then confirmation (module docstring); `run_race` drives it with a measure function."""

    arms: list[Arm]  # plain first
    prompts: list[int]  # the race prompts
    rounds: int = 1  # selection blocks per prompt; confirmation pairs are PAIRS x rounds
    seed: int = 0
    log: list[str] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    selected_on: list[int] = field(default_factory=list)  # selection prompts measured
    confirmation: list[int] = field(default_factory=list)
    winner: Arm | None = None
    loaded_now: bool = False  # the last run (or the caller's probe before the first) was loaded
    groups: dict[int, int] = field(default_factory=dict)  # prompt -> its question (a first turn and its follow-up)
    same_text: bool = False  # every plan decodes one text per prompt (greedy, coupled sampling): steps compare

    def __post_init__(self) -> None:
        n = len(self.prompts)
        k = min(max(CONFIRM_PROMPTS, round(CONFIRM_SHARE * n)), n - 1) if n > 1 else 0
        self.selection = list(self.prompts[: n - k])
        self.confirmation = list(self.prompts[n - k:])
        self.rng = np.random.default_rng(self.seed)
        self._by_key = {a.key: a for a in self.arms}
        self.spare: list[int] = []  # confirmation prompts that were selection prompts: run while time is left
        self._scales: dict[str | None, list[float]] = {}

    @property
    def plain(self) -> Arm:
        return self.arms[0]

    def candidates(self) -> list[Arm]:
        return [a for a in self.arms[1:] if a.running]

    def arm(self, key: str) -> Arm:
        return self._by_key[key]

    # ---- statistics of the selection

    def noise(self) -> float:
        """Per-prompt sd of a plan's log-ratio, pooled over the plans."""
        return _pooled_sd([a.r() for a in self.arms[1:] if a.ratios])

    def offsets(self) -> dict[str | None, float]:
        """How much the predictions overshoot the measurements here (log, median over the measured
        plans predicted the same way, Arm.predicted_by; None: over every measured plan, for a way
        no measured plan shares)."""
        errs: dict[str | None, list[float]] = {}
        for a in self.arms[1:]:
            if a.ratios:
                e = math.log(max(a.predicted_speedup, 1e-9)) - a.mean_r()
                errs.setdefault(a.predicted_by, []).append(e)
                errs.setdefault(None, []).append(e)
        return {k: statistics.median(v) for k, v in errs.items()}

    def score(self, a: Arm, noise: float | None = None, offsets: dict | None = None) -> float:
        """Posterior mean log-speedup: measured mean over prompts and the prior (see module doc)."""
        off = self.offsets() if offsets is None else offsets
        prior = math.log(max(a.predicted_speedup, 1e-9)) - off.get(a.predicted_by, off.get(None, 0.0))
        if not a.ratios:
            return prior
        s = self.noise() if noise is None else noise
        w_m, w_p = len(a.ratios) / s ** 2, 1.0 / PRIOR_SD ** 2
        return (w_m * a.mean_r() + w_p * prior) / (w_m + w_p)

    def ranked(self) -> list[Arm]:
        """Running plans, best posterior first; while the machine is loaded, parallel plans last
        (their runs would not count: the time goes to plans whose runs do)."""
        s, off = self.noise(), self.offsets()
        return sorted(self.candidates(), key=lambda a: (a.parallel and self.loaded_now, -self.score(a, s, off)))

    def leader(self) -> Arm:
        return next(iter(self.ranked()), self.plain)

    def prune(self, stage: int) -> list[Arm]:
        """Drop plans slower than the leader or than plain beyond the noise (Z_DROP)."""
        lead, out = self.leader(), []
        s = self.noise()
        diffs = {a.key: self._diff(lead, a) for a in self.candidates() if a is not lead}
        s_d = _pooled_sd(list(diffs.values()), default=math.sqrt(2) * s)
        for a in self.candidates():
            n = len(a.ratios)
            if a is lead or n < 2:
                continue
            d = diffs[a.key]
            if len(d) >= 2 and sum(d) / len(d) > Z_DROP * s_d / math.sqrt(len(d)):
                a.dropped = f"slower than {lead.key}: {math.exp(-sum(d) / len(d)):.2f}x of it over {len(d)} prompts"
            elif a.mean_r() < -Z_DROP * s / math.sqrt(n):
                a.dropped = f"slower than plain: {math.exp(a.mean_r()):.2f}x over {n} prompts"
            if a.dropped:
                out.append(a)
        if out:
            self.log.append(f"prompt {stage}: dropped {', '.join(a.key for a in out)} (slower than {lead.key} or plain)")
        return out

    @staticmethod
    def _diff(a: Arm, b: Arm) -> list[float]:
        return [a.ratios[p] - b.ratios[p] for p in sorted(set(a.ratios) & set(b.ratios))]

    def halve(self, stage: int) -> list[Arm]:
        """Successive halving: keep the better half of the running plans by posterior (plain stays)."""
        ranked = self.ranked()
        out = ranked[max(1, math.ceil(len(ranked) / 2)):]
        for a in out:
            a.dropped = f"slower half: the time left at prompt {stage} did not fit every plan"
        if out:
            self.log.append(f"prompt {stage}: time budget, kept the better half, dropped {', '.join(a.key for a in out)}")
        return out

    # ---- selection blocks

    def selection_order(self, keys: list[str] | None = None) -> list[str]:
        """P a b c P d e f P ...: the plans shuffled, plain at both ends and every PLAIN_EVERY plans."""
        plans = [a.key for a in self.candidates()] if keys is None else list(keys)
        out = []
        for _ in range(self.rounds if keys is None else 1):
            order = [plans[i] for i in self.rng.permutation(len(plans))]
            out.append(PLAIN)
            for i in range(0, len(order), PLAIN_EVERY):
                out += order[i: i + PLAIN_EVERY] + [PLAIN]
        return out

    def add_selection(self, prompt: int, runs: list[Run]) -> list[str]:
        """Record a selection block (runs in time order); returns the plans left without a paired
        ratio on this prompt because the load changed around them (the driver re-measures those)."""
        self._record(runs)
        if prompt not in self.selected_on:
            self.selected_on.append(prompt)
        plain_at = [i for i, r in enumerate(runs) if r.key == PLAIN]
        got: dict[str, list[float]] = {}
        unpaired = []
        for i, run in enumerate(runs):
            a = self.arm(run.key)
            a.add_time(prompt, run.seconds)
            if run.key == PLAIN:
                continue
            if a.parallel and run.loaded:
                a.loaded_runs += 1
                continue
            ref = self._plain_reference(runs, plain_at, i)
            if ref is None:
                unpaired.append(run.key)
            else:
                got.setdefault(run.key, []).append(ref - math.log(run.seconds))
        for key, vals in got.items():
            a = self.arm(key)
            vals += [a.ratios[prompt]] if prompt in a.ratios else []
            a.ratios[prompt] = sum(vals) / len(vals)
        self._drop_unmeasured_parallel(prompt)
        return [k for k in dict.fromkeys(unpaired) if prompt not in self.arm(k).ratios]

    @staticmethod
    def _plain_reference(runs: list[Run], plain_at: list[int], i: int) -> float | None:
        """log plain seconds at run i's time: the least-squares line (log seconds over time)
        through the block's plain runs that share its load state, so the plain runs' own noise
        averages out while a drift cancels; None when no plain run shares its state."""
        same = [runs[j] for j in plain_at if runs[j].loaded == runs[i].loaded]
        if not same:
            return None
        mid = lambda r: r.start + 0.5 * r.seconds  # noqa: E731
        t = np.array([mid(r) for r in same])
        y = np.log([r.seconds for r in same])
        if len(same) == 1 or np.ptp(t) <= 0:
            return float(y.mean())
        slope, icept = np.polyfit(t, y, 1)
        return float(icept + slope * mid(runs[i]))

    def _drop_unmeasured_parallel(self, prompt: int) -> None:
        for a in self.candidates():
            if a.parallel and not a.ratios and a.loaded_runs >= 2:
                others = [r.others for r in self.runs if r.key == a.key and r.others is not None]
                a.dropped = (f"loaded: runs two jobs on their own cores and was measured only while other "
                             f"processes took {np.median(others):.1f} cores (not the plan a free machine runs)")
                self.log.append(f"{a.key}: {a.dropped}")

    # ---- confirmation

    def select(self) -> Arm | None:
        """The selection's winner: the leader, or a cheaper plan within TIE of it; selection
        prompts left unused join the end of the confirmation while time is left (the winner was not
        chosen on them), unless they share a question with a prompt it was chosen on (a follow-up
        repeats its first turn)."""
        seen = {self.groups.get(p, ("own", p)) for p in self.selected_on}
        unused = [p for p in self.selection if p not in self.selected_on and self.groups.get(p, ("own", p)) not in seen]
        self.confirmation = [p for p in self.confirmation if p not in unused] + unused
        self.spare = unused
        measured = [a for a in self.ranked() if a.ratios]
        if not measured:
            return None
        s, off = self.noise(), self.offsets()
        best = self.score(measured[0], s, off)
        tied = [a for a in measured if self.score(a, s, off) >= best - TIE]
        cost, how = self.tie_costs(tied)
        self.winner = min(tied, key=lambda a: (cost[a.key], -self.score(a, s, off)))
        if len(tied) > 1:
            others = ", ".join(a.key for a in tied if a is not self.winner)
            costs = ", ".join(f"{a.key} {cost[a.key]:.3g}" for a in tied)
            self.log.append(f"selection: a tie within {TIE:g} (log) of the leader {measured[0].key}; "
                            f"{self.winner.key} is cheaper than {others} by {how} ({costs})")
        return self.winner

    def tie_costs(self, tied: list[Arm]) -> tuple[dict[str, float], str]:
        """What a tie is broken on, per arm, and its name. Where every plan decodes one text
        (same_text) each plan's step count on a prompt is exact while its time there is noisy: the
        cost is the profile's time for the steps it took on the text every tied plan decoded (cost
        x steps; the race prompts, and the acceptance prompts' text where each was replayed over it,
        REPLAYED), so of two plans the timing cannot order, the one that needs fewer steps of a
        similar price wins. Otherwise (sampled texts differ per plan) the predicted step cost."""
        common = set.intersection(*(set(a.steps) for a in tied)) if self.same_text else set()
        if common:
            what = " and the acceptance prompts' replay" if REPLAYED in common else ""
            return {a.key: a.cost * sum(a.steps[p] for p in common) for a in tied}, \
                f"predicted time for its steps on the shared text ({len(common - {REPLAYED})} race prompts{what})"
        return {a.key: a.cost for a in tied}, "predicted step cost"

    def confirmation_order(self, pairs: int) -> list[str]:
        """`pairs` pairs of (winner, plain), each in the order of a coin flip."""
        w = self.winner.key
        return [k for _ in range(pairs) for k in ([w, PLAIN] if self.rng.random() < 0.5 else [PLAIN, w])]

    def add_confirmation(self, prompt: int, runs: list[Run]) -> int:
        """Record confirmation pairs (consecutive runs); returns how many did not count because
        their two runs disagree on the load state (the driver re-measures those). A parallel
        plan's loaded pairs do not count either (and are not re-measured: see parallel_blocked)."""
        self._record(runs)
        w, bad = self.winner, 0
        for a, b in zip(runs[0::2], runs[1::2]):
            plan, plain = (a, b) if a.key == w.key else (b, a)
            w.add_time(prompt, plan.seconds)
            self.plain.add_time(prompt, plain.seconds)
            if a.loaded != b.loaded:
                bad += 1
            elif w.parallel and plan.loaded:
                w.loaded_runs += 1
            else:
                w.pairs.append((prompt, math.log(plain.seconds / plan.seconds)))
        return bad

    def parallel_blocked(self) -> bool:
        """A parallel winner's last two runs were loaded: more confirmation runs would not count."""
        w = self.winner
        last = [r for r in self.runs if r.key == w.key][-2:]
        return w.parallel and len(last) == 2 and all(r.loaded for r in last)

    def confirmed_ratios(self) -> np.ndarray:
        """Per confirmation prompt, the mean log-ratio of the winner's pairs there."""
        by: dict[int, list[float]] = {}
        for p, v in self.winner.pairs:
            by.setdefault(p, []).append(v)
        return np.array([np.mean(v) for v in by.values()], dtype=np.float64)

    def decide(self) -> Decision:
        """The plan to write: the winner when the confirmation test rejects at ALPHA, else plain."""
        w = self.winner
        none = Interval(1.0, 1.0, 1.0, len(self.plain.seconds))
        if w is None:
            measured = [a for a in self.arms[1:] if a.ratios]
            why = "no plan was measured" if not measured else "no plan was left to confirm"
            return Decision(PLAIN, none, why)
        sel = speedup(w)
        if w.dropped:
            return Decision(PLAIN, none, f"the selection's winner {w.key} left the race: {w.dropped}")
        if not w.pairs:
            if w.mean_r() <= 0:
                return Decision(PLAIN, none, f"every plan measured slower than plain (the best, {w.key}, at {sel})")
            return Decision(PLAIN, none, f"the selection's winner {w.key} ({sel} on {len(w.ratios)} prompts) could "
                                         "not be confirmed: no time left")
        x = self.confirmed_ratios()
        up, p = interval(x), sign_flip_p(x)
        where = f"selected at {sel} on {len(w.ratios)} prompts, confirmed on {len(x)} other prompts ({len(w.pairs)} pairs)"
        if p <= ALPHA and x.mean() > 0:
            return Decision(w.key, up, f"{where}: {up} plain, p = {p:.3f} (false-winner rate <= {ALPHA:g})", p)
        return Decision(PLAIN, none, f"{w.key} {where}: {up} plain, p = {p:.3f} > {ALPHA:g}: not faster beyond "
                                     "the noise, plain decoding is the cheaper plan", p)

    # ---- time

    def expected_s(self, key: str, prompt: int) -> float:
        """An arm's predicted seconds on the prompt, scaled by how its runs (or all runs) compared."""
        own, every = self._scales.get(key), self._scales.get(None)
        k = statistics.median(own) if own else statistics.median(every) if every else 1.0
        return self.arm(key).predicted_s.get(prompt, 0.0) * k

    def _record(self, runs: list[Run]) -> None:
        """Keep the runs, and each one's measured / predicted seconds for the time estimates."""
        self.runs += runs
        known = [r for r in runs if r.others is not None]
        self.loaded_now = known[-1].loaded if known else self.loaded_now
        for r in runs:
            pred = self.arm(r.key).predicted_s.get(r.prompt, 0.0)
            if pred > 0:
                self._scales.setdefault(r.key, []).append(r.seconds / pred)
                self._scales.setdefault(None, []).append(r.seconds / pred)

    def seconds_of(self, keys: list[str], prompt: int) -> float:
        return sum(self.expected_s(k, prompt) for k in keys)

    def selection_seconds(self, prompt: int) -> float:
        """A selection block on the prompt with every running plan (selection_order's runs)."""
        plans = [a.key for a in self.candidates()]
        plain_runs = 1 + math.ceil(len(plans) / PLAIN_EVERY)
        return self.rounds * (self.seconds_of(plans, prompt) + plain_runs * self.expected_s(PLAIN, prompt))

    def confirmation_seconds(self, pairs: int = 1) -> float:
        """The confirmation with the current leader, `pairs` pairs on every confirmation prompt."""
        lead = self.leader().key
        return sum(self.seconds_of([lead, PLAIN], p) * pairs for p in self.confirmation)

    def to_json(self) -> dict:
        others = [r.others for r in self.runs if r.others is not None]
        spread = [np.log(max(t) / min(t)) for t in self.plain.times.values() if len(t) >= 2]
        return {
            "alpha": ALPHA, "selection_prompts": self.selected_on, "confirmation_prompts": self.confirmation,
            "stages": len(self.selected_on) + len({p for p, _ in self.winner.pairs} if self.winner else ()),
            "winner": self.winner.key if self.winner else None, "log": self.log,
            "same_text": self.same_text,  # then each plan's steps per prompt (REPLAYED: its replay's) compare
            "steps": {a.key: {str(p): n for p, n in sorted(a.steps.items())} for a in self.arms[1:] if a.steps},
            "machine": {"loaded_cores": LOADED_CORES, "runs": len(self.runs), "loaded_runs": sum(r.loaded for r in self.runs),
                        "others_cores_median": float(np.median(others)) if others else None,
                        "others_cores_max": float(max(others)) if others else None,
                        "plain_spread_median": float(np.exp(np.median(spread))) if spread else None},
            "runs": [[r.key, r.prompt, round(r.seconds, 4), round(r.start, 3), None if r.others is None else round(r.others, 2)]
                     for r in self.runs],
        }


# ------------------------------------------------------------------ the driver


def run_race(race: Race, measure: Callable[[str, int], Run], seconds_left: Callable[[], float],
             check: Callable[[int, list[str]], None] | None = None,
             progress: Callable[[str, int], None] | None = None) -> Decision:
    """Selection prompt by prompt (halving, then stopping, when the next prompt and the
    confirmation do not fit the time left), then the winner's confirmation on every confirmation
    prompt, as many pairs per prompt as fit the time left and at least one: a dropped prompt costs the
    sign-flip test its power (with 5 pairs one slower prompt already puts p above 0.05).
    measure(key, prompt) decodes once and returns the Run; check(prompt, keys) runs after each
    block, before any elimination (the caller's output checks drop wrong plans there);
    progress(phase, prompt) after it."""
    def block(keys: list[str], p: int) -> list[Run]:
        return [measure(k, p) for k in keys]

    for i, p in enumerate(race.selection, 1):
        if len(race.candidates()) <= (1 if i > 1 else 0):
            break
        fits = lambda: race.selection_seconds(p) + race.confirmation_seconds() <= seconds_left()  # noqa: E731
        while not fits() and len(race.candidates()) > 2 and race.halve(i):
            pass
        if not fits() and i > 1:
            race.log.append(f"prompt {i}: selection stopped, the time left goes to the confirmation")
            break
        keys = race.selection_order()
        redo = race.add_selection(p, block(keys, p))
        if redo and race.seconds_of(redo, p) * 1.5 + race.confirmation_seconds() <= seconds_left():
            race.log.append(f"prompt {i}: load changed around {', '.join(redo)}: measured again")
            more = race.selection_order(redo)
            race.add_selection(p, block(more, p))
            keys += more
        if check:
            check(p, keys)
        race.prune(i)
        if progress:
            progress("selection", p)
    if race.select() is None or race.winner.mean_r() <= 0:
        return race.decide()
    top = PAIRS * race.rounds
    pairs = next((k for k in range(top, 1, -1) if race.confirmation_seconds(k) <= seconds_left()), 1)
    if pairs < top:
        race.log.append(f"confirmation: {pairs} pair(s) per prompt fit the time left (of {top})")
    for p in list(race.confirmation):  # every one, whatever the time left: each prompt dropped costs the test power
        w = race.winner
        if w.dropped:
            break
        keys = race.confirmation_order(pairs)
        if p in race.spare and race.seconds_of(keys, p) > seconds_left():
            race.log.append(f"confirmation: selection prompts left unused, from {p} on: past the budget, not measured")
            race.confirmation = race.confirmation[: race.confirmation.index(p)]
            break
        if race.seconds_of(keys, p) > seconds_left():
            race.log.append(f"confirmation prompt {p}: past the budget (the confirmation runs on every prompt)")
        bad = race.add_confirmation(p, block(keys, p))
        if bad and race.seconds_of([w.key, PLAIN], p) * bad <= seconds_left():
            race.log.append(f"confirmation prompt {p}: load changed within {bad} pair(s): measured again")
            more = race.confirmation_order(bad)
            race.add_confirmation(p, block(more, p))
            keys += more
        if check:
            check(p, keys)
        if progress:
            progress("confirmation", p)
        if race.parallel_blocked():
            race.log.append(f"confirmation stopped at prompt {p}: other processes take a core, and {w.key} "
                            "runs two jobs on their own cores: its loaded runs do not count")
            break
    return race.decide()
