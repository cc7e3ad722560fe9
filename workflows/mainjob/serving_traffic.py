"""The serving main job's requests: the acceptance and race halves of the user's `--workload`, else of the
built-in traffic (held-out questions' first turns and input-repeating requests on validation documents, as
the serving benchmark sends, on texts it never sends). docs/vllm.md, "The built-in traffic"."""

from __future__ import annotations

from planner.errors import UserError


def requests(s) -> tuple[list, list]:  # s: the run's ServingSettings (serving.py imports this module)
    """(acceptance requests, race requests): disjoint halves of the user's workload (even / odd lines), else
    of the built-in traffic, chats and input-repeating requests as the serving benchmark sends (mixed):
    the held-out questions (training/splits.py: never trained on, never benchmarked) and requests to
    rewrite, summarise, correct or list validation documents the benchmark leaves out."""
    from profiler.workload import Request

    if s.workload:
        from profiler.workload import read_workload

        rows = read_workload(s.workload, default_max_tokens=s.max_tokens)
        accept, race = rows[0::2], rows[1::2]
        if len(race) < 2:
            raise UserError(f"{s.workload}: {len(rows)} requests; the race needs at least 4 (half measure acceptance)")
        return accept[:s.accept_requests], race[:s.race_requests]
    from training.splits import accept_and_race, tuning_repeats
    from workflows.cli.inputs import DEFAULT_QUESTIONS

    # every held-out question's first turn, disjoint halves: the benchmark's chats are first turns too (a
    # follow-up that reworks its first answer is a text suffix decoding matches: 1.97 tokens a drafting step
    # raced on two-turn chats, 1.61 served on the benchmark's, 2026-12-04)
    a, r = accept_and_race(DEFAULT_QUESTIONS, 8, 8)
    for flag, n in (("--accept-prompts", s.accept_requests), ("--decode-prompts", s.race_requests)):
        if n - n // 2 > len(a):
            raise UserError(f"{flag} {n}: the built-in traffic holds {2 * len(a)} requests a half ({len(a)} held-out "
                            "questions and as many input-repeating requests); give --workload FILE for more")
    n_rep_a, n_rep_r = s.accept_requests // 2, s.race_requests // 2
    rep_a, rep_r = tuning_repeats(n_rep_a, n_rep_r)

    def req(text: str):  # single turns: accept_and_race's default and tuning_repeats give text
        return Request(messages=[{"role": "user", "content": text}], max_tokens=s.max_tokens)

    accept = mixed(spread(a, turns=1)[:s.accept_requests - n_rep_a], rep_a)
    race = mixed(spread(r, turns=1)[:s.race_requests - n_rep_r], rep_r)
    return [req(p) for p in accept], [req(p) for p in race]


def mixed(chats: list, repeats: list, block: int = 2) -> list:
    """Chats and input-repeating requests alternating `block` at a time (a question's two turns stay
    together where the chats are two-turn), the rest of the longer list after: any prefix a budget cut races
    holds both kinds."""
    out = []
    for i in range(0, max(len(chats), len(repeats)), block):
        out += chats[i:i + block] + repeats[i:i + block]
    return out


def spread(prompts: list, turns: int = 2) -> list:
    """The questions (each its `turns` prompts together) with the first half's and the second half's alternating.
    The held-out questions come in MT-bench's category order (writing, roleplay, reasoning, math, then coding,
    extraction, STEM, humanities), and a level the budget cuts races the first requests only: in file order its 8
    would hold none of coding and extraction, where lookup accepts most, while the prediction rests on acceptance
    over all eight categories. Spread, any prefix of whole questions spans both halves of the categories."""
    qs = [prompts[i:i + turns] for i in range(0, len(prompts), turns)]
    half = (len(qs) + 1) // 2
    order = [q for pair in zip(qs[:half], qs[half:] + [None]) for q in pair if q is not None]
    return [p for q in order for p in q]
