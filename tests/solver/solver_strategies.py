"""Random layout problems for the solver tests.

Values are small integers times a unit, so distinct assignments differ by at least one unit and an
exact solver must match brute force to rounding. The seconds unit varies over nine orders of magnitude
to exercise the ILP's scaling; bytes come in MB.
"""
from hypothesis import strategies as st

from autopar.solver import Choice, Edge, MemoryConstraint, Problem, SharedBytes, SharedEdge

MB = 1e6


@st.composite
def matrices(draw, rows, cols, unit):
    kind = draw(st.sampled_from(["random", "constant", "separable"]))
    ints = st.integers(0, 20)
    if kind == "constant":
        v = draw(ints)
        return tuple(tuple(unit * v for _ in range(cols)) for _ in range(rows))
    if kind == "separable":   # a[i] + b[j]: linear in the choices, needs no pair variables
        a, b = draw(st.lists(ints, min_size=rows, max_size=rows)), draw(st.lists(ints, min_size=cols, max_size=cols))
        return tuple(tuple(unit * (ai + bj) for bj in b) for ai in a)
    return tuple(tuple(unit * draw(ints) for _ in range(cols)) for _ in range(rows))


@st.composite
def problems(draw, max_choices=8, memory=None):
    """memory: True/False forces memory constraints on/off; None draws it."""
    n = draw(st.integers(1, max_choices))
    unit = draw(st.sampled_from([1e-6, 1e-3, 1.0, 1e3]))
    sizes = [draw(st.sampled_from([1, 2, 2, 3, 3, 4, 4])) for _ in range(n)]   # single options now and then
    choices = [Choice(f"c{c}", tuple(unit * draw(st.integers(0, 20)) for _ in range(k)),
                      count=draw(st.integers(1, 4))) for c, k in enumerate(sizes)]
    edges = []
    for _ in range(draw(st.integers(0, 2 * n))):
        s, d = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))   # self-edges and repeats too
        edges.append(Edge(s, d, draw(matrices(sizes[s], sizes[d], unit)), count=draw(st.integers(1, 4))))
    def requests(src):
        """(readers, a table of n_req rows over the source's options, always) of one shared value."""
        n_req = draw(st.integers(1, 3))
        readers = tuple((c, tuple(draw(st.integers(-1, n_req - 1)) for _ in range(sizes[c])))
                        for c in draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3)))
        return readers, n_req, tuple(draw(st.lists(st.integers(0, n_req - 1), max_size=1)))

    shared = []
    for _ in range(draw(st.integers(0, n))):   # one value read by several choices, each request paid once
        src = draw(st.integers(0, n - 1))
        readers, n_req, always = requests(src)
        cost = tuple(tuple(unit * draw(st.integers(0, 20)) for _ in range(sizes[src])) for _ in range(n_req))
        shared.append(SharedEdge(src, readers, cost, always, count=draw(st.integers(1, 3))))
    p = Problem(choices=choices, edges=edges, shared=shared)
    if memory if memory is not None else draw(st.booleans()):
        for k in range(draw(st.integers(1, 3))):
            idx = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n))   # repeats allowed
            terms = tuple((c, tuple(MB * draw(st.integers(0, 50)) for _ in range(sizes[c]))) for c in idx)
            # Pair terms, negative entries included: recomputation takes bytes away from a layout's.
            pairs = tuple((a, b, tuple(tuple(MB * draw(st.integers(-10, 40)) for _ in range(sizes[b]))
                                       for _ in range(sizes[a])))
                          for a, b in draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)),
                                                    max_size=2)))
            # Copies of a value, each request's held once however many readers make it (a fixed source too).
            copies = []
            for _ in range(draw(st.integers(0, 2))):
                src = draw(st.sampled_from([None, *range(n)]))
                readers, n_req, always = requests(src)
                table = tuple(tuple(MB * draw(st.integers(0, 30)) for _ in range(1 if src is None else sizes[src]))
                              for _ in range(n_req))
                copies.append(SharedBytes(src, readers, table, always))
            p.memory.append(MemoryConstraint(f"m{k}", terms, constant=MB * draw(st.integers(0, 20)), pairs=pairs,
                                             shared=tuple(copies)))
        # A limit between the least and the most any constraint could need: some fit, some do not.
        lo = min(m.constant + sum(min(per) for _, per in m.terms) + sum(min(map(min, per)) for *_, per in m.pairs)
                 for m in p.memory)
        hi = max(m.constant + sum(max(per) for _, per in m.terms) + sum(max(map(max, per)) for *_, per in m.pairs)
                 + sum(max(row) for c in m.shared for row in c.bytes) for m in p.memory)
        p.memory_budget = MB * draw(st.integers(int(lo / MB), int(hi / MB)))
    return p


def unit_of(p: Problem) -> float:
    """The smallest nonzero cost: any two objective values differ by a multiple of it."""
    vals = [v for c in p.choices for v in c.costs] + [v for e in p.edges for row in e.cost for v in row]
    vals += [v for e in p.shared for row in e.cost for v in row]
    return min((v for v in vals if v), default=1.0)
