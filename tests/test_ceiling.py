"""The oracle ceiling (planner/ceiling.py) and lookup's offered / accepted lengths (decoder/guessers/lookup.py)."""
from __future__ import annotations

import pytest

from decoder.guessers.lookup import available_lengths
from planner.ceiling import oracle_ceiling, simulate_fixed
from planner.errors import UserError


def test_ceiling_is_the_cheapest_path():
    c = oracle_ceiling([2, 0, 0, 0], [1.0, 1.5, 1.8])
    assert c.plain_s == 4.0 and c.oracle_s == pytest.approx(2.8) and c.guesses == [2, 0]
    # a guess that costs more than the step it saves is not taken
    c = oracle_ceiling([1, 1, 1, 1], [1.0, 2.5])
    assert c.guesses == [0, 0, 0, 0] and c.speedup == 1.0
    # never past the answer's end: the last token is always a step's own
    assert oracle_ceiling([5], [1.0, 1.1]).guesses == [0]


def test_fixed_rule_pays_for_rejected_guesses():
    assert simulate_fixed([3, 0, 0, 0], [2, 0, 0, 0], [1.0, 1.5, 1.8]) == pytest.approx(2.8)
    assert simulate_fixed([1, 1, 1, 1], [0, 0, 0, 0], [1.0, 1.5]) == pytest.approx(6.0)
    with pytest.raises(UserError, match="positive seconds"):
        oracle_ceiling([0], [0.0])


def test_available_lengths_match_the_answer():
    prompt = [5, 6, 7, 8, 9]
    answer = [5, 6, 7, 1, 5, 6]
    offered, available = available_lengths(prompt, answer, num_tokens=3)
    # i=0: history ends in 9 (no earlier 9): nothing; i=1: ...9,5 -> the earlier 5 is followed by 6,7,8
    assert offered[0] == 0 and available[0] == 0
    assert offered[1] == 3 and available[1] == 2  # 6, 7 right, 8 wrong (answer has 1)
    assert available[5] == 1 and oracle_ceiling(available, [1.0, 1.1]).guesses[-1] == 0  # the end caps it


def test_per_step_lookup_index_finds_what_a_scan_finds():
    """decoder.guessers.lookup.History keeps an n-gram index (a dict read per step, not a scan of the text):
    its continuation and follow counts are a brute-force scan's."""
    import random

    from decoder.guessers.lookup import History

    def scan(h, max_ngram, min_ngram, k):
        for n in range(min(max_ngram, len(h) - 1), min_ngram - 1, -1):
            starts = [s for s in range(len(h) - n) if h[s: s + n] == h[len(h) - n:]]
            if starts:
                return h[starts[-1] + n: starts[-1] + n + k], n, starts
        return [], 0, []

    rng = random.Random(0)
    for _ in range(200):
        vocab = rng.choice([3, 6, 30])
        text = [rng.randrange(vocab) for _ in range(rng.randrange(3, 50))]
        max_ngram = rng.choice([1, 2, 3])
        hist = History(text[:1], range(1, max_ngram + 1))
        h = text[:1]
        for t in text[1:]:
            hist.push([t])
            h.append(t)
            m = hist.continuation(max_ngram, 1, 6)
            follow, n, starts = scan(h, max_ngram, 1, 6)
            assert (m.tokens, m.ngram) == (follow, n)
            for j, c in enumerate(hist.follow_counts(m)):
                starts = [s for s in starts if s + n + j < len(h) and h[s + n + j] == follow[j]]
                assert c == max(1, len(starts))


def test_with_nothing_to_guess_the_oracle_is_plain_to_the_last_bit():
    """The shortest path sums N plain steps where plain is N times one: the sum rounded one ulp above it
    (speedup 0.9999999999999999 in a llama.cpp main job), and an oracle is never slower than plain."""
    from planner.ceiling import oracle_ceiling

    for n in range(1, 400):
        c = oracle_ceiling([0] * n, [0.0123 + n * 1e-7, 1.0])
        assert c.plain_s / c.oracle_s >= 1.0 and c.guesses == [0] * n
