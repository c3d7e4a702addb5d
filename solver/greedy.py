"""A fast deterministic heuristic: the ILP's warm start, its fallback, and a baseline for tests."""
from __future__ import annotations

import math

from .problem import Problem

_ROUNDS = 10   # coordinate-descent sweeps; each strictly lowers the objective, most stop after two or three


def greedy(problem: Problem) -> tuple[int, ...]:
    """Assign choices in index order, repair memory violations, then improve one choice at a time.

    Ties always go to the lowest option index, so the result depends only on the problem.
    """
    problem.validate()
    n = len(problem.choices)
    unary = [[ch.count * c for c in ch.costs] for ch in problem.choices]
    # adj[c]: (neighbour, count, matrix indexed [option of c][option of neighbour]).
    adj: list[list[tuple[int, int, tuple[tuple[float, ...], ...]]]] = [[] for _ in range(n)]
    for e in problem.edges:
        if e.src == e.dst:   # a folded layer feeding itself: both ends take the same option
            for i in range(len(unary[e.src])):
                unary[e.src][i] += e.count * e.cost[i][i]
        else:
            adj[e.src].append((e.dst, e.count, e.cost))
            adj[e.dst].append((e.src, e.count, tuple(zip(*e.cost))))

    a = [-1] * n   # -1: not assigned yet
    shared_of: list[list] = [[] for _ in range(n)]
    for e in problem.shared:
        for c in {e.src, *(c for c, _ in e.readers)}:
            shared_of[c].append(e)

    def shared_seconds(e) -> float:
        if a[e.src] < 0:
            return 0.0
        made = set(e.always) | {reqs[a[c]] for c, reqs in e.readers if a[c] >= 0 and reqs[a[c]] >= 0}
        return e.count * sum(e.cost[r][a[e.src]] for r in made)

    def local(c: int, i: int) -> float:
        """The part of the objective that depends on choice c, with c at option i."""
        was, a[c] = a[c], i
        shared = sum(shared_seconds(e) for e in shared_of[c])
        a[c] = was
        return unary[c][i] + sum(k * m[i][a[o]] for o, k, m in adj[c] if a[o] >= 0) + shared

    for c in range(n):
        a[c] = min(range(len(unary[c])), key=lambda i: local(c, i))

    # Memory bookkeeping: per-choice bytes of each constraint (terms of one choice summed), and the pair
    # and shared terms each choice is part of.
    limit = problem.memory_budget
    members: list[dict[int, list[float]]] = [{} for _ in problem.memory]   # constraint -> choice -> bytes
    pairs_of: list[dict[int, list]] = [{} for _ in problem.memory]         # constraint -> choice -> pairs
    shared_in: list[dict[int, list]] = [{} for _ in problem.memory]        # constraint -> choice -> shared
    for k, m in enumerate(problem.memory):
        for c, per in m.terms:
            acc = members[k].setdefault(c, [0.0] * len(per))
            for i, v in enumerate(per):
                acc[i] += v
        for pair in m.pairs:
            for c in {pair[0], pair[1]}:
                pairs_of[k].setdefault(c, []).append(pair)
                members[k].setdefault(c, [0.0] * len(problem.choices[c].costs))
        for sb in m.shared:
            for c in sb.choices():
                shared_in[k].setdefault(c, []).append(sb)
                members[k].setdefault(c, [0.0] * len(problem.choices[c].costs))
    touches: list[list[int]] = [[] for _ in range(n)]   # choice -> the constraints it changes
    for k, mem in enumerate(members):
        for c in mem:
            touches[c].append(k)
    usage = list(problem.memory_usage(a).values())
    cap = None if limit is None else limit * (1 + 1e-9)   # the same tolerance as Problem.feasible

    def delta(k: int, c: int, j: int) -> float:
        """How much switching c to option j changes constraint k's bytes."""
        d = members[k][c][j] - members[k][c][a[c]]
        pairs, shared = pairs_of[k].get(c, ()), shared_in[k].get(c, ())
        if pairs or shared:
            def joint() -> float:
                return sum(per[a[s]][a[t]] for s, t, per in pairs) + sum(sb.at(a) for sb in shared)

            was = joint()
            a_c, a[c] = a[c], j
            d += joint() - was
            a[c] = a_c
        return d

    def excess_change(c: int, j: int) -> float:
        """How much switching c to option j changes the total violation (bytes over the limit)."""
        if cap is None:
            return 0.0
        return sum(max(0.0, usage[k] + delta(k, c, j) - cap) - max(0.0, usage[k] - cap) for k in touches[c])

    def switch(c: int, j: int) -> None:
        for k in touches[c]:
            usage[k] += delta(k, c, j)
        a[c] = j

    # Repair: relieve the most violated constraint at the best price in seconds per byte of violation
    # removed. Every move strictly lowers the total violation, so no assignment repeats and it ends.
    while cap is not None and usage and max(usage) > cap:
        worst = max(range(len(usage)), key=lambda k: usage[k])
        best = None
        for c in members[worst]:
            for j in range(len(problem.choices[c].costs)):
                if delta(worst, c, j) >= 0:
                    continue
                relief = -excess_change(c, j)
                if relief > 0:
                    price = (local(c, j) - local(c, a[c])) / relief
                    if best is None or price < best[0]:
                        best = (price, c, j)
        if best is None:
            break   # nothing helps: the caller sees an infeasible assignment
        switch(best[1], best[2])

    # Coordinate descent: move one choice to its best option given the others, never adding violation.
    for _ in range(_ROUNDS):
        moved = False
        for c in range(n):
            best_j, best_v = a[c], local(c, a[c])
            for j in range(len(unary[c])):
                v = local(c, j)
                better = v < best_v and (math.isinf(best_v) or v < best_v - 1e-12 * abs(best_v))
                if better and excess_change(c, j) <= 0:
                    best_j, best_v = j, v
            if best_j != a[c]:
                switch(c, best_j)
                moved = True
        if not moved:
            break
    return tuple(a)
