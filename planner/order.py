"""The order a budgeted sweep visits values in: ends first, then midpoints level by level (breadth-first
bisection), so a budget that runs out early still leaves the whole range covered. The profiler's
lengths, the matmul paths' row counts and the planner's input lengths all sweep this way.

    coarse_to_fine([1, 2, 3, 4, 5])   # [5, 1, 3, 2, 4]
"""
from __future__ import annotations


def coarse_to_fine(values) -> list:
    values = list(values)
    m = len(values)
    order = [m - 1, 0][: min(m, 2)]
    level = [(0, m - 1)]
    while level:
        nxt = []
        for lo, hi in level:
            if hi - lo > 1:
                mid = (lo + hi) // 2
                order.append(mid)
                nxt += [(lo, mid), (mid, hi)]
        level = nxt
    return [values[i] for i in order]
