"""PEARL: parallel speculative decoding, drafting while verifying (Liu et al. 2024, arXiv:2408.11850;
docs/seed-systems.md, section 'PEARL').

    out = generate(engine, ids, Pearl(drafter, gamma=4), max_new_tokens=128)     # decoder/loop.py's one loop

PEARL is a strategy of the one decoding loop (decoder/loop.py): the loop owns the prompt, EOS,
max_new_tokens, the clock and the progress bar; a step is one round. The drafter is any
decoder/drafter.py DraftModel (a transformers causal LM is wrapped as one: decoder/torch_ops/draft.py),
the target is the engine, so neither side is reached past its interface.

Every round two jobs run at the same time and one coordinator decides after both finish:
  drafter  gamma sequential forwards continuing `accepted + pending` (its first input is the last
           token of that sequence), producing x_1..x_gamma and, when sampling, q_1..q_gamma;
  target   one forward over `accepted[-1:] + pending`: n = 1 in mode A (pre-verify: it scores
           the drafter's first token of this round early), n = gamma in mode B (post-verify: it
           verifies the pending tokens while the drafter already drafts the next window).
The checks are `pending + [x_1]`, target row i against check i (the authors' code's indices, not
Algorithm 2's). All accepted: emit them, pending <- x_2..x_gamma, go to (or stay in) B; no bonus
token is sampled (the last target row verified x_1). First rejection at check i: emit the i
accepted tokens and y' ~ norm(max(p_i - q_i, 0)) (greedy: argmax p_i), crop both caches to the
accepted text before y', pending <- [], go to A. Mode A is the case pending = [].

Cache invariants (tests check them after every round against from-scratch prefills):
  target cache  == accepted[:-1]                 (the target never keeps a rejected token)
  drafter cache == (accepted + pending)[:-1]     (its unverified drafts, fed, are cropped on rejections)

Concurrency: the drafter's job runs in a worker thread, the target's in the caller's thread; each
sets its torch thread count in its own thread (`set_thread_count`: OpenMP and MKL counts are per
thread, so the cores are split between the two jobs; tests check each side's forwards run at its
count, bench/bench_pearl.py measures whether the overlap pays on the machine). On
CUDA each side runs on its own stream (written, untested: no GPU was lent to this task).
concurrent=False runs the same two jobs one after the other, with the same thread split and the
same random streams (the drafter samples from its own generator, the coordinator from another), so
outputs and decisions are identical; each round is then also booked as max(draft, target) + decide.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from decoder.config import DecodeConfig
from decoder.engine import StepInput
from decoder.guessers.draft import draft_children
from decoder.layout import layout_for
from decoder.torch_ops.draft import HFDraft
from decoder.verify import Sampling, Verdict, probabilities, residual
from planner.errors import UserError

SIDES = ("draft", "target", "coordinator")


@dataclass
class PearlRound:
    """One round. checks: draft tokens the target looked at (1 in mode A, gamma in B)."""

    mode: str  # "A" (pre-verify) or "B" (post-verify)
    checks: int
    accepted: int  # checks accepted before the first rejection
    produced: int  # tokens the round decided (accepted, plus y' after a rejection)
    emitted: int  # after EOS / max_new_tokens truncation
    draft_s: float
    target_s: float
    decide_s: float
    wall_s: float  # real time of the round (concurrent: both jobs overlap; serial: their sum)

    @property
    def booked_s(self) -> float:
        """The round as if the two jobs overlapped perfectly: max(draft, target) + decide."""
        return max(self.draft_s, self.target_s) + self.decide_s


@dataclass
class PhaseEvent:
    side: str  # draft, target, coordinator
    phase: str  # prefill, draft, pre-verify, verify, decide
    start: float  # seconds since the call began
    end: float


@dataclass
class PearlStats:
    gamma: int
    concurrent: bool
    threads: tuple[int, int] | None  # (target, drafter) CPU threads; None on CUDA
    rounds: list[PearlRound] = field(default_factory=list)
    events: list[PhaseEvent] = field(default_factory=list)
    prefill_s: float = 0.0
    prefill_booked_s: float = 0.0
    total_s: float = 0.0

    @property
    def booked_s(self) -> float:
        return self.prefill_booked_s + sum(r.booked_s for r in self.rounds)

    def summary(self) -> dict:
        n = len(self.rounds)
        tokens = sum(r.emitted for r in self.rounds)
        accepted = sum(r.accepted for r in self.rounds)
        rejected = sum(r.accepted < r.checks for r in self.rounds)  # a round stops at its first rejection
        return {
            "rounds": n, "steps": n, "tokens": tokens,
            "tokens_per_round": tokens / n if n else 0.0,
            "tokens_per_step": tokens / n if n else 0.0,  # a round is one target forward
            "mode_a": sum(r.mode == "A" for r in self.rounds), "mode_b": sum(r.mode == "B" for r in self.rounds),
            "accepted": accepted, "rejected": rejected,
            # the maximum-likelihood per-token acceptance (planner.pearl.alpha_from_counts)
            "acceptance_rate": accepted / (accepted + rejected) if accepted + rejected else None,
            "gamma": self.gamma, "concurrent": self.concurrent, "threads": self.threads,
            "prefill_s": self.prefill_s, "total_s": self.total_s, "booked_s": self.booked_s,
            "tokens_per_s": tokens / self.total_s if self.total_s > 0 else None,
            "booked_tokens_per_s": tokens / self.booked_s if self.booked_s > 0 else None,
            "draft_s": sum(r.draft_s for r in self.rounds), "target_s": sum(r.target_s for r in self.rounds),
            "decide_s": sum(r.decide_s for r in self.rounds),
        }

    def to_json(self) -> dict:
        return {"rounds": [dict(vars(r), booked_s=r.booked_s) for r in self.rounds],
                "events": [vars(e) for e in self.events], "summary": self.summary()}


@dataclass
class PearlState:
    """The decoder's state between rounds (handed to `on_round`; tests compare the caches)."""

    accepted: list[int]  # prompt + emitted tokens
    pending: list[int]  # drafted, not yet verified (mode B)
    pending_q: list[torch.Tensor | None]  # q [V] (host, float64) each pending token was drawn from; None: greedy
    mode: str
    target_cache: object  # the target sequence's cache (the hf engine's), for the tests' checks
    draft: object  # the drafter's DraftState (decoder/drafter.py): its cache holds (accepted + pending)[:-1]
    target: object = None  # the target's engine sequence (decoder/engine.py): its cache holds accepted[:-1]


@dataclass
class _Side:
    threads: int | None
    stream: object  # torch.cuda.Stream or None

    def context(self):
        """Per job: the side's thread count (per OS thread) and stream; inference mode is per thread too."""
        if self.threads is not None:
            set_thread_count(self.threads)
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


def set_thread_count(k: int) -> None:
    """torch.set_num_threads(k) for the calling OS thread only (OpenMP's and MKL's counts are per
    thread). ATen initialises a thread's count lazily, on its first parallel op, from the process-wide
    value that the last set_num_threads in any thread left; get_num_threads runs that initialisation
    first, so it cannot later overwrite k with the other side's count (measured: without it a fresh
    worker thread ran at the caller's count)."""
    torch.get_num_threads()
    torch.set_num_threads(k)


@dataclass
class _Draft:
    tokens: list[int]  # x_1..x_gamma
    q: list[torch.Tensor | None]  # [V] host float64 per token (sampling), else None
    span: tuple[float, float]


@dataclass
class _Scored:
    argmax: list[int]  # per row, greedy
    p: torch.Tensor | None  # [n, V] host float64 (sampling)
    span: tuple[float, float]


@dataclass
class Pearl:
    """PEARL as the plan's strategy: generate(engine, ids, Pearl(drafter, gamma)). Greedy at temperature 0
    (token-identical to plain greedy decoding), else lossless sampling (accept x with min(1, p(x)/q(x)),
    reject to norm(max(p - q, 0)); p with temperature, top-k, top-p; q the drafter's own warped distribution
    with the same settings, see decoder.guessers.draft.draft_children): PEARL verifies by its own rule,
    whatever the config's.

    threads: CPU threads per side: None (split torch.get_num_threads(): target ceil(n/2), drafter
    floor(n/2), at least 1 each), an int total to split the same way, or (target, drafter).
    on_round(PearlState): called after every round (tests); its time counts in total_s only."""

    drafter: object  # a decoder/drafter.py DraftModel, or a transformers causal LM (wrapped as one)
    gamma: int
    threads: object = None
    concurrent: bool = True
    on_round: object = None
    label = "PEARL"
    batches = False

    def __post_init__(self):
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or self.gamma < 1:
            raise UserError(f"gamma: expected an integer >= 1, got {self.gamma!r}")
        if isinstance(self.drafter, torch.nn.Module):
            self.drafter = HFDraft(self.drafter)
        if self.drafter.features:
            raise UserError(f"{self.drafter.label}: PEARL feeds its drafter tokens only; a drafter that reads the "
                            "target's features cannot draft while the target verifies")

    def start(self, engine, ids: torch.Tensor, cfg: DecodeConfig) -> "PearlRun":
        _check(engine, self.drafter, ids.numel(), cfg.max_new_tokens, self.gamma)
        return PearlRun(self, engine, ids, cfg)


def split_threads(threads) -> tuple[int, int]:
    """(target, drafter) CPU threads: see Pearl."""
    if threads is None:
        threads = torch.get_num_threads()
    if isinstance(threads, int) and not isinstance(threads, bool):
        if threads < 1:
            raise UserError(f"threads: expected an integer >= 1, got {threads}")
        return max(1, threads - threads // 2), max(1, threads // 2)
    pair = tuple(threads)
    if len(pair) != 2 or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in pair):
        raise UserError(f"threads: expected an integer or (target, drafter) integers >= 1, got {threads!r}")
    return pair


def _check(engine, drafter, prompt_len: int, max_new_tokens: int, gamma: int) -> None:
    if drafter.vocab_size != engine.vocab_size:
        raise UserError(f"{drafter.label}: vocabulary of {drafter.vocab_size} tokens, the target has "
                        f"{engine.vocab_size}: a drafter must share the target's tokenizer")
    # the drafter runs up to 2 gamma - 1 tokens past the accepted text (a B round's pending + its new drafts)
    longest = prompt_len + max_new_tokens + 2 * gamma
    for name, limit in (("target", engine.max_positions), (drafter.label, drafter.max_positions)):
        if limit is not None and longest > limit:
            raise UserError(f"{name}: prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) + 2 gamma "
                            f"({2 * gamma}) exceeds the {limit} positions it holds")


class PearlRun:
    """One sequence's rounds (decoder/loop.py's Run): both sides prefilled at start, a round per step."""

    def __init__(self, plan: Pearl, engine, ids: torch.Tensor, cfg: DecodeConfig):
        device = engine.device
        self.gamma, self.concurrent, self.on_round = plan.gamma, plan.concurrent, plan.on_round
        self.split = split_threads(plan.threads) if device.type == "cpu" else None
        streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if device.type == "cuda" else (None, None)
        self.tside = _Side(self.split[0] if self.split else None, streams[0])
        self.dside = _Side(self.split[1] if self.split else None, streams[1])
        self.dtype, self.device = engine.dtype, engine.device
        s = cfg.sampling
        self.sampling = Sampling(s.temperature, s.top_k, s.top_p)
        self.gens = (torch.Generator().manual_seed(cfg.seed),  # the drafter's draws (its thread only)
                     torch.Generator().manual_seed(cfg.seed + 1))  # the coordinator's draws
        self.stats = PearlStats(plan.gamma, plan.concurrent, self.split)
        self.ended = False
        self.caller_threads = torch.get_num_threads()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pearl-draft")
        try:
            self._prefill(plan.drafter, engine, ids, cfg.max_new_tokens)
        except BaseException:
            self.close()
            raise

    def _prefill(self, drafter, engine, ids: torch.Tensor, max_new_tokens: int) -> None:
        t0 = time.perf_counter()
        self.clock = lambda: time.perf_counter() - t0  # noqa: E731
        (dstate, ds), (tseq, ts) = _both(self.pool, self.concurrent, lambda: _open_draft(self.dside, drafter, ids, self.clock),
                                         lambda: _start_target(self.tside, engine, ids, self.clock))
        engine.check_room(tseq, max_new_tokens, 2 * self.gamma)
        self.stats.events += [PhaseEvent("target", "prefill", *ts), PhaseEvent("draft", "prefill", *ds)]
        self.stats.prefill_booked_s = max(ts[1] - ts[0], ds[1] - ds[0])
        self.st = PearlState(ids.tolist(), [], [], "A", getattr(tseq, "cache", None), dstate, tseq)

    @property
    def steps(self) -> int:
        return len(self.stats.rounds)

    def step(self) -> list[int]:
        """Both jobs, then the coordinator's decisions: the tokens the round produced."""
        st, clock = self.st, self.clock
        self.round_start, self.mode = clock(), st.mode
        seq = st.accepted + st.pending
        self.fed = st.accepted[-1:] + st.pending  # n = 1 (A) or gamma (B)
        self.draft, self.scored = _both(self.pool, self.concurrent,
                                        lambda: _draft_job(self.dside, st.draft, seq, self.gamma, self.sampling,
                                                           self.gens[0], clock, self.device),
                                        lambda: _target_job(self.tside, st.target, self.fed, self.sampling, clock, self.dtype))
        self.decide_start = clock()
        self.produced, self.accepted = _decide(st, self.draft, self.scored, self.sampling, self.gens[1])
        return self.produced

    def settle(self, kept: list[int], stop: bool) -> None:
        end, d0 = self.clock(), self.decide_start
        draft, scored = self.draft, self.scored
        self.stats.events += [PhaseEvent("draft", "draft", *draft.span),
                              PhaseEvent("target", "pre-verify" if self.mode == "A" else "verify", *scored.span),
                              PhaseEvent("coordinator", "decide", d0, end)]
        self.stats.rounds.append(PearlRound(self.mode, len(self.fed), self.accepted, len(self.produced), len(kept),
                                            draft.span[1] - draft.span[0], scored.span[1] - scored.span[0], end - d0,
                                            end - self.round_start))
        if self.on_round is not None:
            self.on_round(self.st)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        torch.set_num_threads(self.caller_threads)  # also the default a new thread starts with


def _both(pool, concurrent: bool, draft_job, target_job):
    """(draft_job(), target_job()): the drafter's in the worker thread, the target's in this one;
    concurrently, or the drafter's first and then the target's (same threads, same results)."""
    future = pool.submit(draft_job)
    if not concurrent:
        future.result()
    t = target_job()
    return future.result(), t


def _open_draft(side: _Side, drafter, ids: torch.Tensor, clock):
    """The drafter's cache over every prompt token but the last (the first round feeds it)."""
    with torch.inference_mode(), side.context():
        t = clock()
        state = drafter.open(ids, None)
        side.sync()
        return state, (t, clock())


def _start_target(side: _Side, engine, ids: torch.Tensor, clock):
    """The target engine's sequence over every prompt token but the last."""
    with torch.inference_mode(), side.context():
        t = clock()
        seq, _ = engine.start(ids)
        side.sync()
        return seq, (t, clock())


def _draft_job(side: _Side, state, seq: list[int], gamma: int, s: Sampling, gen, clock, dev) -> _Draft:
    """gamma forwards continuing seq (the drafter's cache holds seq[:-1]): x_1..x_gamma and their q."""
    sampled = s.rule == "lossless"
    with torch.inference_mode(), side.context():
        t = clock()
        tok, pos = seq[-1], len(seq) - 1
        tokens, qs = [], []
        for i in range(gamma):
            out = state.forward(torch.tensor([tok], device=dev), torch.tensor([pos + i], device=dev), None, None,
                                last_only=True)
            x, q = draft_children(out.logits[-1], 1, s, sampled, gen)
            tok = int(x[0])  # a host read: the job ends synchronised
            tokens.append(tok)
            qs.append(q.double().cpu() if q is not None else None)
        return _Draft(tokens, qs, (t, clock()))


def _target_job(side: _Side, seq, fed: list[int], s: Sampling, clock, dtype: torch.dtype) -> _Scored:
    """One forward over `fed` (a causal chain after the target's cache, which holds accepted[:-1]),
    kept in the cache: each row's argmax, and p when sampling."""
    with torch.inference_mode(), side.context():
        t = clock()
        n = len(fed)
        tokens = torch.tensor(fed, dtype=torch.long, device=seq.root.device)
        layout = layout_for(tuple((0,) * d for d in range(1, n)), 1, dtype, tokens.device)
        logits, _ = seq.score(StepInput(tokens, layout))  # [n, V]
        keep = list(range(n))
        seq.commit(Verdict(torch.arange(n, device=tokens.device), keep, [], tokens[-1:]))
        if s.rule == "greedy":
            return _Scored(logits.argmax(-1).tolist(), None, (t, clock()))
        p = probabilities(logits, s).double().cpu()  # [n, V]
        return _Scored([], p, (t, clock()))


def _decide(st: PearlState, draft: _Draft, scored: _Scored, s: Sampling, gen) -> tuple[list[int], int]:
    """Check pending + [x_1] against the target's rows in order; update st (tokens, pending, mode,
    caches). Returns the tokens the round produced and how many checks were accepted."""
    checks = st.pending + draft.tokens[:1]
    qs = st.pending_q + draft.q[:1]
    produced: list[int] = []
    for i, (x, q) in enumerate(zip(checks, qs)):
        if _accept(scored, i, x, q, s, gen):
            produced.append(x)
            continue
        produced.append(_replacement(scored, i, q, gen))
        st.accepted += produced
        st.pending, st.pending_q, st.mode = [], [], "A"
        keep = len(st.accepted) - 1  # everything before y'
        st.target.rollback(keep)
        st.draft.keep(keep, [])
        return produced, i
    st.accepted += produced
    st.pending, st.pending_q, st.mode = draft.tokens[1:], draft.q[1:], "B"
    return produced, len(checks)


def _accept(scored: _Scored, row: int, x: int, q, s: Sampling, gen) -> bool:
    if scored.p is None:
        return scored.argmax[row] == x
    p = scored.p[row]
    ratio = float(p[x]) / float(q[x]) if float(q[x]) > 0 else float("inf")
    return float(torch.rand((), generator=gen, dtype=torch.float64)) < min(1.0, ratio)


def _replacement(scored: _Scored, row: int, q, gen) -> int:
    """The target's token after a rejection: argmax (greedy) or a draw from norm(max(p - q, 0))."""
    if scored.p is None:
        return scored.argmax[row]
    return int(torch.multinomial(residual(scored.p[row], q), 1, generator=gen))
