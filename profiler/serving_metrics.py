"""Read vLLM's speculative-decoding counters from its Prometheus `/metrics` page.

    from profiler.serving_metrics import fetch_spec_decode
    before = fetch_spec_decode("http://127.0.0.1:8000")
    ...  # one load level
    level = fetch_spec_decode("http://127.0.0.1:8000") - before
    level.acceptance_rate, level.mean_acceptance_length, level.accepted_per_position

The names are vLLM 0.32's (vllm/v1/spec_decode/metrics.py, `SpecDecodingProm`): counters
`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
`..._num_accepted_tokens_per_pos` (label `position`, 0-based, one per speculative token), which the
Prometheus client exposes with a `_total` suffix. They are cumulative since the server started, so a
level is the difference of two readings. A server that does not speculate exposes none of them:
the reading is all zeros with `speculating` False. Counters are summed over the other labels
(`engine`, `model_name`): one server, one total.
"""
from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

from planner.errors import UserError

PREFIX = "vllm:spec_decode_"
DRAFTS = PREFIX + "num_drafts_total"
DRAFT_TOKENS = PREFIX + "num_draft_tokens_total"
ACCEPTED = PREFIX + "num_accepted_tokens_total"
ACCEPTED_PER_POS = PREFIX + "num_accepted_tokens_per_pos_total"
# name{labels} value [timestamp]; label values may hold escaped quotes
_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)'
                     r'(?:\{(?P<labels>(?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"(?P<value>(?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class SpecDecodeCounters:
    """Cumulative speculative-decoding counts (or, after subtraction, one interval's)."""
    drafts: float = 0.0  # verification steps that carried a draft
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_position: tuple[float, ...] = ()  # accepted tokens at draft position 0, 1, ...
    speculating: bool = False  # the server exposes the counters at all

    def __sub__(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        n = max(len(self.accepted_per_position), len(before.accepted_per_position))
        per_pos = tuple(a - b for a, b in zip(_padded(self.accepted_per_position, n),
                                              _padded(before.accepted_per_position, n)))
        return SpecDecodeCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                                  self.accepted_tokens - before.accepted_tokens, per_pos, self.speculating)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verification step: the accepted ones plus the one the target adds itself."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None

    @property
    def acceptance_per_position(self) -> tuple[float, ...]:
        """The fraction of drafts whose token at each position was accepted."""
        return tuple(a / self.drafts for a in self.accepted_per_position) if self.drafts else ()


def _padded(xs: tuple[float, ...], n: int) -> tuple[float, ...]:
    return xs + (0.0,) * (n - len(xs))


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line of a Prometheus text page."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        labels = {lm["key"]: lm["value"] for lm in _LABEL.finditer(m["labels"] or "")}
        out.append((m["name"], labels, value))
    return out


def spec_decode_counters(text: str) -> SpecDecodeCounters:
    """The speculative-decoding counters of one `/metrics` page."""
    totals = {DRAFTS: 0.0, DRAFT_TOKENS: 0.0, ACCEPTED: 0.0}
    per_pos: dict[int, float] = {}
    seen = False
    for name, labels, value in parse_samples(text):
        if name in totals:
            totals[name] += value
            seen = True
        elif name == ACCEPTED_PER_POS and labels.get("position", "").isdigit():
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
    positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else ()
    return SpecDecodeCounters(totals[DRAFTS], totals[DRAFT_TOKENS], totals[ACCEPTED], positions, seen)


def fetch_metrics(url: str, timeout_s: float = 10.0) -> str:
    """The server's `/metrics` page (no proxy: the server is local)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
            return r.read().decode("utf-8")
    except OSError as e:
        raise UserError(f"{url}/metrics: cannot read the server's metrics ({getattr(e, 'reason', e)})") from None


def fetch_spec_decode(url: str, timeout_s: float = 10.0) -> SpecDecodeCounters:
    return spec_decode_counters(fetch_metrics(url, timeout_s))
