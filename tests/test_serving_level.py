"""One concurrency level on a server (profiler/serving_level.py), shared by the main job's race and
bench/bench_serving.py: the warm-up wave goes first and outside the counters, the rounds follow in
order, and the counters' change covers exactly the rounds; unreadable metrics are None, not a crash."""
import pytest

import profiler.load_generator as lg
import profiler.serving_metrics as sm
from planner.errors import UserError
from profiler.load_generator import LoadResult, RequestRecord, TokenRequest
from profiler.serving_level import measure_level
from profiler.serving_metrics import SpecDecodeCounters


def _fake(monkeypatch, metrics_fail=False):
    log, accepted = [], [0.0]

    def run_load(url, model, reqs, concurrency, timeout_s):
        log.append(("load", concurrency, [r.max_tokens for r in reqs]))
        accepted[0] += 10 * len(reqs)  # the server's counters move with every request, warm-up included
        records = [RequestRecord(i, 0.0, output_tokens=r.max_tokens) for i, r in enumerate(reqs)]
        return LoadResult(concurrency, 1.0, records)

    def fetch(url):
        log.append(("metrics",))
        if metrics_fail:
            raise UserError(f"{url}/metrics: cannot read the server's metrics (refused)")
        return SpecDecodeCounters(drafts=accepted[0] / 2, draft_tokens=accepted[0] * 2, accepted_tokens=accepted[0],
                                  speculating=True)

    monkeypatch.setattr(lg, "run_load", run_load)
    monkeypatch.setattr(sm, "fetch_spec_decode", fetch)
    return log


def test_the_warmup_is_outside_the_counters_and_the_rounds_run_in_order(monkeypatch):
    log = _fake(monkeypatch)
    warm = [TokenRequest([1], 3)] * 4
    rounds = [[TokenRequest([1], 5)] * 2, [TokenRequest([1], 7)] * 3]
    seen = []
    run = measure_level("http://127.0.0.1:1", "m", warm, rounds, 4, 30.0,
                        lambda i, res: seen.append((i, res.concurrency)))
    assert log == [("load", 4, [3] * 4), ("metrics",), ("load", 4, [5, 5]), ("load", 4, [7, 7, 7]), ("metrics",)]
    assert [r.output_tokens for r in run.rounds] == [10, 21] and run.warmup.output_tokens == 12
    assert seen == [(0, 4), (1, 4)]
    assert run.spec.accepted_tokens == 50.0  # the 5 round requests' counts, not the 4 warm-up ones'
    assert run.spec.speculating


def test_the_server_empties_its_prefix_cache_before_the_warmup(monkeypatch):
    log = _fake(monkeypatch)
    measure_level("http://127.0.0.1:1", "m", [TokenRequest([1], 3)], [[TokenRequest([1], 5)]] * 2, 1, 30.0,
                  fresh=lambda: log.append(("fresh",)))
    assert log[:2] == [("fresh",), ("load", 1, [3])] and log.count(("fresh",)) == 1


def test_unreadable_metrics_give_no_counters_and_the_race_fails_the_contender(monkeypatch):
    _fake(monkeypatch, metrics_fail=True)
    run = measure_level("http://127.0.0.1:1", "m", [TokenRequest([1], 2)], [[TokenRequest([1], 2)]], 1, 30.0)
    assert run.spec is None and len(run.rounds) == 1

    import contextlib

    import workflows.mainjob.serving_race as sr

    class Engine:
        @contextlib.contextmanager
        def server(self, speculative_config=None, plugin=False):
            yield type("S", (), {"url": "http://127.0.0.1:1", "served_model_name": "m"})()

    reqs = [TokenRequest([1], 2)] * 5
    with pytest.raises(UserError, match=r"/metrics: the server's counters could not be read at concurrency 2"):
        sr.race_contender(Engine(), sr.Contender("c", {"method": "ngram"}),
                          sr.Race(sr.same_requests(reqs, reqs[:1], [2], 1, None, 30.0), [2], lambda line: None))
