"""PEARL: parallel speculative decoding, drafting while verifying (Liu et al. 2024, arXiv:2408.11850;
docs/seed-systems.md, section 'PEARL').

    out = generate_pearl(target, draft_model, ids, gamma=4, max_new_tokens=128)

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

from decoder.config import DecodeConfig, decode_config
from decoder.engine import StepInput, vocab_size
from decoder.torch_ops.cache import crop_cache
from decoder.torch_ops.forward import kv
from decoder.engines.registry import as_engine
from decoder.guessers.draft import draft_children
from decoder.layout import layout_for
from decoder.loop import _eos, _ids_1d
from decoder.output import truncate
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
class PearlOutput:
    tokens: torch.Tensor  # [T_new] long, new tokens only
    rounds: int
    stats: PearlStats
    batch = None  # not a field: `planner decode` reads GenerateOutput's attributes

    @property
    def steps(self) -> int:
        """Target forwards after the prefill: one per round."""
        return self.rounds


@dataclass
class PearlState:
    """The decoder's state between rounds (handed to `on_round`; tests compare the caches)."""

    accepted: list[int]  # prompt + emitted tokens
    pending: list[int]  # drafted, not yet verified (mode B)
    pending_q: list[torch.Tensor | None]  # q [V] (host, float64) each pending token was drawn from; None: greedy
    mode: str
    target_cache: object  # the target sequence's transformers cache (hf engine), for the tests' checks
    draft_cache: object
    target: object = None  # the target's engine sequence (decoder/engine.py): its cache holds accepted[:-1]


@dataclass
class _Side:
    model: object  # the drafter's transformers model; the target's engine (decoder/engine.py)
    threads: int | None
    stream: object  # torch.cuda.Stream or None

    def context(self):
        """Per job: the side's thread count (per OS thread) and stream; inference mode is per thread too."""
        if self.threads is not None:
            set_thread_count(self.threads)
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()


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


def generate_pearl(target, draft_model, input_ids, gamma: int, max_new_tokens: int | None = None, *,
                   config: DecodeConfig | None = None, concurrent: bool = True, threads=None, on_round=None,
                   **options) -> PearlOutput:
    """Decode with PEARL. Greedy at temperature 0 (token-identical to plain greedy decoding), else
    lossless sampling (accept x with min(1, p(x)/q(x)), reject to norm(max(p - q, 0)); p with
    temperature, top-k, top-p; q the drafter's own warped distribution with the same settings, see
    decoder.guessers.draft.draft_children).

    threads: CPU threads per side: None (split torch.get_num_threads(): target ceil(n/2), drafter
    floor(n/2), at least 1 each), an int total to split the same way, or (target, drafter).
    on_round(PearlState): called after every round (tests); its time counts in total_s only.
    config / options: decoder/config.py's DecodeConfig or its fields (max_new_tokens, temperature, top_k,
    top_p, eos_token_id, seed); PEARL verifies by its own lossless rule, whatever the config's.
    """
    cfg = decode_config(config, **(options if max_new_tokens is None else dict(options, max_new_tokens=max_new_tokens)))
    max_new_tokens, eos_token_id, seed = cfg.max_new_tokens, cfg.eos_token_id, cfg.seed
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise UserError(f"gamma: expected an integer >= 1, got {gamma!r}")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
    sampling = Sampling(cfg.sampling.temperature, cfg.sampling.top_k, cfg.sampling.top_p)
    engine = as_engine(target)
    device = engine.device
    ids = _ids_1d(input_ids, device).tolist()
    _check_pair(engine, draft_model, len(ids), max_new_tokens, gamma)
    split = split_threads(threads) if device.type == "cpu" else None
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if device.type == "cuda" else (None, None)
    tside = _Side(engine, split[0] if split else None, streams[0])
    dside = _Side(draft_model.eval(), split[1] if split else None, streams[1])
    caller_threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pearl-draft")
    try:
        return _decode(tside, dside, pool, ids, gamma, max_new_tokens, sampling, _eos(engine, eos_token_id),
                       seed, concurrent, split, on_round)
    finally:
        pool.shutdown(wait=True)
        torch.set_num_threads(caller_threads)  # also the default a new thread starts with


def split_threads(threads) -> tuple[int, int]:
    """(target, drafter) CPU threads: see generate_pearl."""
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


def _check_pair(engine, draft, prompt_len: int, max_new_tokens: int, gamma: int) -> None:
    vt = vocab_size(engine)
    vd = draft.get_input_embeddings().weight.shape[0]
    if vt != vd:
        raise UserError(f"draft model: vocabulary of {vd} tokens, the target has {vt}: a drafter must share the "
                        "target's tokenizer")
    # the drafter runs up to 2 gamma - 1 tokens past the accepted text (a B round's pending + its new drafts)
    longest = prompt_len + max_new_tokens + 2 * gamma
    if engine.max_positions is not None and longest > engine.max_positions:
        raise UserError(f"target: prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) + 2 gamma "
                        f"({2 * gamma}) exceeds the model's {engine.max_positions} positions")
    models = [("draft model", draft)] + ([("target", engine.model)] if hasattr(engine, "model") else [])
    for name, m in models:
        max_pos = getattr(m.config, "max_position_embeddings", None)
        if max_pos is not None and longest > max_pos:
            raise UserError(f"{name}: prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) + 2 gamma "
                            f"({2 * gamma}) exceeds the model's {max_pos} positions")
        window = getattr(m.config, "sliding_window", None) if getattr(m.config, "use_sliding_window", True) else None
        if isinstance(window, int) and longest >= window:
            raise UserError(f"{name}: sliding window of {window} tokens: prompt + max_new_tokens + 2 gamma "
                            f"({longest}) must stay below it (a cache past the window cannot be cropped back)")


@torch.inference_mode()
def _decode(tside: _Side, dside: _Side, pool, ids: list[int], gamma: int, max_new_tokens: int, s: Sampling,
            eos: set[int], seed: int, concurrent: bool, split, on_round) -> PearlOutput:
    stats = PearlStats(gamma, concurrent, split)
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    gens = (torch.Generator().manual_seed(seed),  # the drafter's draws (its thread only)
            torch.Generator().manual_seed(seed + 1))  # the coordinator's draws
    (dcache, ds), (tseq, ts) = _both(pool, concurrent, lambda: _prefill(dside, ids, clock),
                                     lambda: _start_target(tside, ids, clock))
    stats.events += [PhaseEvent("target", "prefill", *ts), PhaseEvent("draft", "prefill", *ds)]
    stats.prefill_s = clock()
    stats.prefill_booked_s = max(ts[1] - ts[0], ds[1] - ds[0])
    st = PearlState(list(ids), [], [], "A", getattr(tseq, "cache", None), dcache, tseq)
    new: list[int] = []
    while len(new) < max_new_tokens:
        kept, stop = _round(st, tside, dside, pool, gamma, s, gens, concurrent, clock, stats, eos,
                            max_new_tokens - len(new))
        new += kept
        if on_round is not None:
            on_round(st)
        if stop:
            break
    stats.total_s = clock()
    return PearlOutput(torch.tensor(new, dtype=torch.long), len(stats.rounds), stats)


def _round(st: PearlState, tside: _Side, dside: _Side, pool, gamma: int, s: Sampling, gens, concurrent: bool, clock,
           stats: PearlStats, eos: set[int], room: int) -> tuple[list[int], bool]:
    """Both jobs, then the coordinator's decisions; returns the tokens kept and whether to stop."""
    start = clock()
    mode = st.mode
    seq = st.accepted + st.pending
    fed = st.accepted[-1:] + st.pending  # n = 1 (A) or gamma (B)
    draft, scored = _both(pool, concurrent,
                          lambda: _draft_job(dside, st.draft_cache, seq, gamma, s, gens[0], clock),
                          lambda: _target_job(tside, st.target, fed, s, clock))
    d0 = clock()
    produced, accepted = _decide(st, draft, scored, s, gens[1])
    kept, stop = truncate(produced, eos, room)
    end = clock()
    stats.events += [PhaseEvent("draft", "draft", *draft.span),
                     PhaseEvent("target", "pre-verify" if mode == "A" else "verify", *scored.span),
                     PhaseEvent("coordinator", "decide", d0, end)]
    stats.rounds.append(PearlRound(mode, len(fed), accepted, len(produced), len(kept), draft.span[1] - draft.span[0],
                                   scored.span[1] - scored.span[0], end - d0, end - start))
    return kept, stop


def _both(pool, concurrent: bool, draft_job, target_job):
    """(draft_job(), target_job()): the drafter's in the worker thread, the target's in this one;
    concurrently, or the drafter's first and then the target's (same threads, same results)."""
    future = pool.submit(draft_job)
    if not concurrent:
        future.result()
    t = target_job()
    return future.result(), t


def _prefill(side: _Side, ids: list[int], clock):
    """A cache of every prompt token but the last (the first round feeds it); a new cache for a 1-token prompt."""
    from transformers import DynamicCache

    with torch.inference_mode(), side.context():
        t = clock()
        cache = DynamicCache(config=side.model.config)
        if len(ids) > 1:
            dev = side.model.get_input_embeddings().weight.device
            side.model(input_ids=torch.tensor([ids[:-1]], device=dev), **kv(cache), use_cache=True,
                       logits_to_keep=1)
            _sync(side)
        return cache, (t, clock())


def _start_target(side: _Side, ids: list[int], clock):
    """The target engine's sequence over every prompt token but the last."""
    with torch.inference_mode(), side.context():
        t = clock()
        seq, _ = side.model.start(torch.tensor(ids, dtype=torch.long, device=side.model.device))
        _sync(side)
        return seq, (t, clock())


def _sync(side: _Side) -> None:
    if side.stream is not None:
        side.stream.synchronize()


def _draft_job(side: _Side, cache, seq: list[int], gamma: int, s: Sampling, gen, clock) -> _Draft:
    """gamma forwards continuing seq (the cache holds seq[:-1]): x_1..x_gamma and their q."""
    sampled = s.rule == "lossless"
    with torch.inference_mode(), side.context():
        t = clock()
        dev = side.model.get_input_embeddings().weight.device
        tok, pos = seq[-1], len(seq) - 1
        tokens, qs = [], []
        for i in range(gamma):
            out = side.model(input_ids=torch.tensor([[tok]], device=dev),
                             position_ids=torch.tensor([[pos + i]], device=dev), **kv(cache), use_cache=True)
            x, q = draft_children(out.logits[0, -1], 1, s, sampled, gen)
            tok = int(x[0])  # a host read: the job ends synchronised
            tokens.append(tok)
            qs.append(q.double().cpu() if q is not None else None)
        return _Draft(tokens, qs, (t, clock()))


def _target_job(side: _Side, seq, fed: list[int], s: Sampling, clock) -> _Scored:
    """One forward over `fed` (a causal chain after the target's cache, which holds accepted[:-1]),
    kept in the cache: each row's argmax, and p when sampling."""
    with torch.inference_mode(), side.context():
        t = clock()
        n = len(fed)
        layout = layout_for(tuple((0,) * d for d in range(1, n)), 1, side.model.dtype, side.model.device)
        tokens = torch.tensor(fed, dtype=torch.long, device=side.model.device)
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
        crop_cache(st.draft_cache, keep)
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
