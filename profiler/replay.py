"""Replaying a decoding session over a known greedy continuation, without the target.

Under greedy decoding the target's token after a path that matches the text is the text's next
token, so a step's accepted path is known without a forward: the longest path of the proposal
whose tokens are the text's. `replay` drives any session (a static tree's, a dynamic plan's
`DynamicSession`, the calibration's recording one) through its own `propose` and `commit`, feeding
each step's outcome as the decode would: the emitted tokens, the next root, the cache length, and
what the guesser reads of the target there:

- hidden states (ParallelSpec, chain): the target's teacher-forced last hidden state at each
  accepted position (one forward per prompt, `teachers`), equal to the tree step's up to float
  rounding, as profiler/teacher_forced.py uses them;
- PPD's prompt-token logits: captured at every root of the shared greedy decode, where PPD rides
  along (`PPDCapture`). A prompt slot sees only the context and its own copy's earlier slots, so
  the logits after an accepted node equal those of a root-only step at that position;
- a draft LM (`TeacherDraft`, static trees and calibration only): its teacher-forced logits at
  every position. Only the children of nodes on the text's path can be accepted or observed, and
  those are the drafter's outputs after the true prefix; off-text nodes get any row.

Drafter passes that are not teacher-forced run for real (the ParallelSpec and chain drafters, the
draft LM of a dynamic plan, whose off-text children's confidences steer its choices). A dynamic
session measures its own decision time as it replays and reports it; it decides with its plan's
fixed `dynamic.decide_s`, so its steps are decoding's on any machine, under any load
(`measure_decide_s` times the decision once, for the plan to record). tests/test_replay.py checks
tokens per step against decoding on the same prompts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from decoder.drafter import teacher_forced
from decoder.engines.registry import as_engine
from decoder.guesser import DecodeContext, StepOutcome
from decoder.verify import Sampling, Verdict
from planner.errors import UserError

KEEP = 32  # logits kept per row (top-KEEP and the rest's mean mass): guessers read their top 4-10
COUPLED_KEEP = 256  # a coupled text's draft rows: aimed guesses rank the warped support (decoder/noise.py)


# ---------------------------------------------------------------------------------------------- compressed logits


@dataclass
class Rows:
    """Logit rows [R, V] kept as their top-KEEP entries and one floor value for every other entry,
    chosen so the softmax's normaliser is the row's own: softmax and top-k (k <= KEEP) of a
    restored row equal the original's (the floor is the mean of the rest, never above the KEEP-th)."""

    values: torch.Tensor  # [R, KEEP] float32
    indices: torch.Tensor  # [R, KEEP] long
    floor: torch.Tensor  # [R] float32
    vocab: int

    @classmethod
    def of(cls, logits: torch.Tensor, keep: int = KEEP) -> "Rows":
        x = logits.detach().float().cpu().reshape(-1, logits.shape[-1])
        V = x.shape[-1]
        k = min(keep, V)
        top = x.topk(k, dim=-1)
        lse = torch.logsumexp(x, dim=-1)
        rest = (1.0 - torch.exp(top.values - lse[:, None]).sum(-1)).clamp_min(1e-30)
        floor = lse + torch.log(rest / max(V - k, 1)) if V > k else torch.full_like(lse, -torch.inf)
        return cls(top.values, top.indices, floor, V)

    def __len__(self) -> int:
        return self.values.shape[0]

    def restore(self, rows) -> torch.Tensor:
        """[len(rows), V] logits."""
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        out = self.floor[rows, None].expand(-1, self.vocab).clone()
        return out.scatter_(1, self.indices[rows], self.values[rows])

    @staticmethod
    def cat(parts: list["Rows"]) -> "Rows":
        return Rows(torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts]),
                    torch.cat([p.floor for p in parts]), parts[0].vocab)


# ---------------------------------------------------------------------------------------------- PPD on the shared decode


class PPDCapture:
    """PPD prompt tokens riding along the shared greedy decode (profiler.teacher_forced's `ppd`),
    keeping at every root the ensemble-mean logits of its prompt tokens: rows[prompt] holds, per
    root i (the prompt's last token, then the continuation's tokens), D rows (distances 1..D)."""

    def __init__(self, inner):
        self.inner = inner
        self.rows: list[list[Rows]] = []

    def __getattr__(self, name):  # everything else is the prompt tokens' own
        return getattr(self.inner, name)

    def begin(self, target, plan, prompt_ids, ctx):
        self.rows.append([])
        return _CaptureSession(self.inner.begin(target, plan, prompt_ids, ctx), self.rows[-1])

    def prompt_rows(self, i: int) -> Rows | None:
        return Rows.cat(self.rows[i]) if i < len(self.rows) and self.rows[i] else None


class _CaptureSession:
    def __init__(self, inner, rows: list):
        self.inner, self.rows = inner, rows

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, root):
        return self.inner.propose(root)

    def commit(self, outcome: StepOutcome) -> None:
        lay = self.inner.layout  # root-only steps carrying every prompt token (profiler.acceptance.chain_plan)
        if outcome.verdict.nodes != [0] or lay.input_length == lay.num_tree:
            raise UserError("PPD capture: expected root-only steps with the prompt tokens along")
        k = lay.prompt_count_list[0]
        self.rows.append(Rows.of(outcome.logits[lay.slot_index[0, :k]].float().mean(dim=1)))  # [k, V]
        self.inner.commit(outcome)


class _SlotLogits:
    """A replayed step's logits where a PPD session reads them: the prompt slots of the last
    accepted node, restored from the capture at that position. Any other read is refused."""

    def __init__(self, rows: Rows, root: int, depth: int, slot_index: torch.Tensor, last: int):
        self.rows, self.root, self.depth, self.slot_index, self.last = rows, root, depth, slot_index, last

    def __getitem__(self, slots):
        k, E = slots.shape[0], slots.shape[1]
        if not torch.equal(slots, self.slot_index[self.last, :k]):
            raise UserError("replay: a session read logits other than the last accepted node's prompt slots")
        row = self.root * self.depth
        return self.rows.restore(range(row, row + k))[:, None, :].expand(k, E, self.rows.vocab)


class _NoLogits:
    def __getitem__(self, _):
        raise UserError("replay: this session reads the target's logits, which a replay does not have")


# ---------------------------------------------------------------------------------------------- teachers


@dataclass
class Teacher:
    """One prompt with the target's greedy continuation and what the target gave along it."""

    prompt: torch.Tensor  # [T]
    tokens: torch.Tensor  # [N]
    # the target's features per position [T + N, F] by decoder.engine.Features spec: the last hidden state (True)
    # for ParallelSpec and EAGLE-1, the streams entering chosen layers for an EAGLE-3 head
    hidden: dict = field(default_factory=dict)
    ppd: Rows | None = None  # per root i (0: the prompt's last token), D rows: PPD's ensemble-mean logits
    ppd_depth: int = 0
    drafts: dict = field(default_factory=dict)  # id(draft model) -> Rows of its teacher-forced logits [T + N]
    probs: torch.Tensor | None = None  # [N, V] a sampled continuation's warped p that drew each token (None: greedy)
    # a coupled continuation (decoder/noise.py): its settings and noise seed, so a replay's guesses aim
    # at the same noise the text was drawn with and the replay is that decode (None: not coupled)
    coupled: tuple | None = None  # (Sampling, seed)

    @property
    def seq(self) -> torch.Tensor:
        return torch.cat([self.prompt, self.tokens])

    def features(self, spec) -> torch.Tensor | None:
        """[T + N, F] the features `spec` names (None: a guesser that reads none, or a teacher without them)."""
        return self.hidden.get(spec) if spec else None

    def draft_rows(self, drafter, device) -> Rows:
        key = id(drafter)
        if key not in self.drafts:
            logits = teacher_forced(drafter, self.seq.to(device))  # the drafter's pass over the text (decoder/drafter.py)
            # coupled: a Gumbel top-k ranks the warped q's whole support (top-k 50 holds more than KEEP)
            self.drafts[key] = Rows.of(logits, COUPLED_KEEP if self.coupled is not None else KEEP)
        return self.drafts[key]


@torch.inference_mode()
def teachers(engine, cont, hidden, capture: PPDCapture | None = None) -> list[Teacher]:
    """A Teacher per prompt of `cont` (profiler.teacher_forced.Continuations, or a sampled one,
    profiler.sampled.SampledContinuations, whose p rows come along); hidden: the feature specs
    (decoder.engine.Features) the measured guessers read, or True for the last hidden state: a
    teacher-forced target forward per prompt and spec."""
    from profiler.teacher_forced import target_pass

    out = []
    drew = getattr(cont, "probs", None) or [None] * len(cont.prompts)
    s = getattr(cont, "sampling", None)
    coupled = s is not None and s.rule == "coupled"
    specs = [spec for spec in ([hidden] if isinstance(hidden, bool) else hidden) if spec]
    for i, (ids, toks) in enumerate(zip(cont.prompts, cont.tokens)):
        h = {spec: target_pass(engine, ids, toks, spec)[1].float().cpu() for spec in specs} if toks.numel() else {}
        rows = capture.prompt_rows(i) if capture is not None else None
        D = rows.values.shape[0] // max(len(capture.rows[i]), 1) if rows is not None else 0
        out.append(Teacher(ids.cpu(), toks.cpu(), h, rows, D, probs=drew[i],
                           coupled=(s, cont.seed + i) if coupled else None))
    return out


# ---------------------------------------------------------------------------------------------- the replay


@dataclass
class Cursor:
    """Where the replay is: the current root's index in the continuation (0: the prompt's last token)."""

    pos: int = 0


class TeacherDraft:
    """A draft LM's cache replaced by its teacher-forced logits (static trees and calibration: the
    module docstring says why that is exact). The DraftCache methods its sessions call."""

    def __init__(self, rows: Rows, T: int, cursor: Cursor, device):
        self.rows, self.T, self.cursor, self.device = rows, T, cursor, device

    def _at(self, offsets) -> torch.Tensor:
        base = self.T - 1 + self.cursor.pos
        return self.rows.restore([min(base + d, len(self.rows) - 1) for d in offsets]).to(self.device)

    def first_pass(self, root: torch.Tensor) -> torch.Tensor:
        return self._at([0])[0]

    def level_pass(self, fed, parent, tokens, depth) -> torch.Tensor:
        return self._at(depth)

    ready = True  # the teacher's rows stand for every position (a drafter that reads no target features)

    def skip(self, root: int) -> None:
        pass

    def keep_outcome(self, accepted, outcome) -> None:
        pass

    def keep_accepted(self, accepted, emitted, features=None) -> None:
        pass


def use_teacher_drafts(session, teacher: Teacher, cursor: Cursor) -> None:
    """Swap the draft LM's cache of a static DraftSession, or of a DraftSource in a dynamic
    session, for its teacher-forced logits."""
    from decoder.guessers.draft import DraftSession
    from decoder.guessers.draft_source import DraftSource

    def fake(cache, device):  # a decoder/guessers/draft_cache.py DraftCache
        return TeacherDraft(teacher.draft_rows(cache.drafter, device), teacher.prompt.numel(), cursor, device)

    # a drafter that reads the target's features drafts deeper levels from its own predicted features, which
    # no teacher-forced pass over the text gives: it keeps its own cache (and its passes)
    if isinstance(session, DraftSession) and not session.reads:
        f = fake(session, session.ctx.device)
        session.first_pass, session.level_pass, session.keep_accepted = f.first_pass, f.level_pass, f.keep_accepted
    for s in getattr(session, "sources", []):
        if isinstance(s, DraftSource) and not s.drafter.reads:
            s.drafter = fake(s.drafter, s.ctx.device)


def context(engine, teacher: Teacher, needs_hidden, label: str = "replay") -> DecodeContext:
    T = teacher.prompt.numel()
    feats = teacher.features(needs_hidden)
    if needs_hidden and feats is None:
        raise UserError(f"{label}: the guesser reads the target's hidden states; the replay has none")
    prompt_hidden = feats[: T - 1].to(device=engine.device, dtype=engine.dtype) if needs_hidden else None
    if teacher.coupled is not None:  # guesses aimed at the noise the text was drawn with
        from decoder.noise import PositionNoise

        s, seed = teacher.coupled
        return DecodeContext(s, torch.Generator().manual_seed(0), engine.dtype, engine.device, label, prompt_hidden,
                             PositionNoise(seed), features=needs_hidden)
    return DecodeContext(Sampling(0.0), torch.Generator().manual_seed(0), engine.dtype, engine.device, label,
                         prompt_hidden, features=needs_hidden)


@dataclass
class Step:
    """One replayed step."""

    input_length: int  # tokens the target's forward would take
    depth: int  # the proposal's tree depth
    accepted: int  # candidates accepted
    propose_s: float  # the session's propose, wall time
    commit_s: float  # its commit (0 for the last step, which the loop does not commit)
    size: int = 0  # candidates proposed
    draft_model_s: float = 0.0  # dynamic plans: drafting the session paid for (its passes x draft_s)
    decide_s: float = 0.0  # dynamic plans: the decision's own time (propose less the drafter passes)


class _Tree:
    """A layout's parent lists on the host, kept per layout (layouts are cached per shape)."""

    def __init__(self):
        self.known: dict[int, tuple] = {}

    def children(self, lay) -> list[list[int]]:
        hit = self.known.get(id(lay))
        if hit is None:
            kids: list[list[int]] = [[] for _ in range(lay.num_tree)]
            for u, p in enumerate(lay.parents.tolist()[1:], start=1):
                kids[p].append(u)
            hit = self.known[id(lay)] = (lay, kids)  # the layout is kept, so its id stays its own
        return hit[1]


def accepted_path(kids: list[list[int]], tokens: list[int], text: list[int], pos: int) -> list[int]:
    """Tree indices root first of the longest path whose tokens are text[pos], text[pos + 1], ...
    (tokens: the candidates in tree order, root excluded). Siblings hold distinct tokens."""
    path, u = [0], 0
    while pos + len(path) < len(text):  # the step also emits the token after the path: it must be known
        want = text[pos + len(path) - 1]
        nxt = next((c for c in kids[u] if tokens[c - 1] == want), None)
        if nxt is None:
            break
        path.append(nxt)
        u = nxt
    return path


@torch.inference_mode()
def replay(session, teacher: Teacher, ctx: DecodeContext, max_new_tokens: int | None = None,
           cursor: Cursor | None = None) -> list[Step]:
    """Run `session` (opened with `ctx`) over the teacher's continuation, its first max_new_tokens,
    as greedy decoding would: per step the proposal, the accepted path, the commit."""
    from decoder.guessers.dynamic import DynamicSession

    text = teacher.tokens.tolist()[:max_new_tokens]
    N, T = len(text), teacher.prompt.numel()
    seq = teacher.seq.to(ctx.device)
    cursor = cursor or Cursor()
    dynamic = isinstance(session, DynamicSession)
    trees, steps, pos = _Tree(), [], 0
    while pos < N:
        cursor.pos = pos
        if ctx.noise is not None:
            ctx.noise.cursor = T + pos  # the index of the token this step emits first, as decoder.loop sets it
        decided = len(session.decide_s) if dynamic else 0
        t0 = time.perf_counter()
        proposal = session.propose(seq[T - 1 + pos: T + pos])
        propose_s = time.perf_counter() - t0
        lay = proposal.layout
        nodes = accepted_path(trees.children(lay), proposal.tokens.tolist(), text, pos)
        a = len(nodes) - 1
        commit_s = 0.0
        if pos + a + 1 < N:  # the loop commits every step but the last
            outcome = _outcome(proposal, nodes, text[pos: pos + a + 1], seq, teacher, ctx, pos)
            t0 = time.perf_counter()
            session.commit(outcome)
            commit_s = time.perf_counter() - t0
        step = Step(lay.input_length, lay.depth, a, propose_s, commit_s, lay.num_tree - 1)
        if dynamic and len(session.decide_s) > decided:  # a plan's session (the calibration's decides nothing)
            step.draft_model_s = session.drafting[-1]  # the session's own price of its passes
            step.decide_s = session.decide_s[-1]
        steps.append(step)
        pos += a + 1
    return steps


def _outcome(proposal, nodes: list[int], emitted: list[int], seq: torch.Tensor, teacher: Teacher,
             ctx: DecodeContext, pos: int) -> StepOutcome:
    """What the loop would commit: the verdict, the hidden states on the accepted path (rows of the
    tree's other nodes are never read), PPD's slots, the cache length after the step."""
    a, T = len(nodes) - 1, teacher.prompt.numel()
    verdict = Verdict(torch.tensor(nodes, device=ctx.device), nodes, emitted, seq[T + pos + a: T + pos + a + 1])
    lay = proposal.layout
    hidden = None
    feats = teacher.features(ctx.features)
    if feats is not None:
        h = feats[T - 1 + pos: T + pos + a]  # the root and the accepted nodes, in path order
        hidden = torch.zeros(lay.num_tree, h.shape[1], dtype=h.dtype)
        hidden[nodes] = h
        hidden = hidden.to(device=ctx.device, dtype=ctx.dtype)
    logits = _NoLogits()
    if teacher.ppd is not None and lay.input_length > lay.num_tree:
        logits = _SlotLogits(teacher.ppd, pos + a, teacher.ppd_depth, lay.slot_index, nodes[-1])
    return StepOutcome(proposal, verdict, logits, hidden, T + pos + a)


def open_session(engine, guesser, plan, teacher: Teacher, teacher_drafts: bool = False):
    """(session, ctx, cursor): `guesser` begun on the teacher's prompt as `generate` would begin it
    (a dynamic plan wraps it in decoder.guessers.dynamic.DynamicGuesser); teacher_drafts: a draft LM's
    passes come from its teacher-forced logits (`TeacherDraft`)."""
    from decoder.guessers.dynamic import DynamicGuesser

    if plan is not None and plan.dynamic is not None and not isinstance(guesser, DynamicGuesser):
        guesser = DynamicGuesser(guesser, plan)
    guesser.check(plan, "replay")
    ctx = context(engine, teacher, guesser.needs_hidden)
    session = guesser.begin(engine, plan, teacher.prompt.to(ctx.device), ctx)
    cursor = Cursor()
    if teacher_drafts:
        use_teacher_drafts(session, teacher, cursor)
    return session, ctx, cursor


def replay_plan(engine, guesser, plan, teacher: Teacher, max_new_tokens: int | None = None,
                teacher_drafts: bool = False) -> list[Step]:
    """The steps decoding `teacher.prompt` with `plan` and `guesser` would take (greedy)."""
    session, ctx, cursor = open_session(engine, guesser, plan, teacher, teacher_drafts)
    return replay(session, teacher, ctx, max_new_tokens, cursor)


DECIDE_STEPS = 32  # decisions timed for a plan's decide_s: a median over at least these (or every prompt's)


def measure_decide_s(engine, guesser, plan, teachers: list[Teacher], max_new_tokens: int | None = None,
                     steps: int = DECIDE_STEPS) -> float:
    """A dynamic plan's decision cost per step, to record in it (`dynamic.decide_s`): the median of
    the decision times its session measures replaying the first prompts, until `steps` are timed.
    Those replays decide with the plan's decide_s as it stands (0 from the planner): the cost is
    measured once, under one fixed value, and the plan then decodes with the constant it records."""
    times: list[float] = []
    for t in teachers:
        times += [s.decide_s for s in replay_plan(engine, guesser, plan, t, max_new_tokens)]
        if len(times) >= steps:
            break
    # a decision's time is its propose less nested pass times: a float hair below 0 is 0
    return max(float(np.median(times)), 0.0) if times else 0.0
