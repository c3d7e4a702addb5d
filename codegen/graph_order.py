"""Reordering a graph after regions of it were replaced by single calls."""
from __future__ import annotations

import heapq

import torch.fx as fx


def stable_toposort(graph: fx.Graph) -> None:
    """Reorder so every node follows its inputs, moving as little as possible: a region's call sits
    where its last op was, and a reader of an earlier output of the region moves after it."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(n.all_input_nodes) for n in nodes}
    ready = [(pos[n], n) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for u in n.users:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (pos[u], u))
    if order != nodes:
        for prev, n in zip(order, order[1:]):
            prev.append(n)
