"""Find repeated layers, so that each unique layer is solved once.

A layer instance is the outermost module whose path ends in a list index (``model.layers.3``,
``transformer.h.0``), as recorded in ``nn_module_stack``. Instances whose nodes have the same
structure (op, shapes, how they connect, the shapes of what comes from outside) form one class; the
node at position ``i`` of every instance in a class is tagged with the same ``(cls, i)``.
"""
from __future__ import annotations

import re
from collections import defaultdict

import torch
import torch.fx as fx

from autopar.passes.meta import LayerTag, meta_of, set_meta

_INDEXED = re.compile(r"^(.*?\.\d+)(\.|$)")
_TRAILING_INDEX = re.compile(r"\.\d+$")


def _instance_of(node: fx.Node) -> str | None:
    role = meta_of(node).role
    if node.op == "placeholder":
        path = role.target if role and role.kind == "param" else None
    else:
        stack = node.meta.get("nn_module_stack") or {}
        path = next((fqn for fqn, _ in stack.values() if _INDEXED.match(fqn or "")), None)
    if not path:
        return None
    m = _INDEXED.match(path)
    return m.group(1) if m else None


def _val_sig(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), str(v.dtype))
    if isinstance(v, (list, tuple)):
        return tuple(_val_sig(x) for x in v)
    return type(v).__name__


def _signature(nodes: list[fx.Node], prefix: str) -> tuple:
    index = {n: i for i, n in enumerate(nodes)}

    def arg_sig(a):
        if isinstance(a, fx.Node):
            return ("in", index[a]) if a in index else ("ext", _val_sig(a.meta.get("val")))
        if isinstance(a, (list, tuple)):
            return tuple(arg_sig(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, arg_sig(v)) for k, v in a.items())
        return repr(a)

    sig = []
    for n in nodes:
        if n.op == "placeholder":
            sig.append(("param", meta_of(n).role.target[len(prefix):], _val_sig(n.meta.get("val"))))
        else:
            sig.append((n.op, str(n.target), arg_sig(n.args), arg_sig(dict(n.kwargs)),
                        _val_sig(n.meta.get("val"))))
    return tuple(sig)


def layers_pass(gm: fx.GraphModule) -> fx.GraphModule:
    instances: dict[str, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "call_function"):
            inst = _instance_of(node)
            if inst is not None:
                instances[inst].append(node)
    classes: dict[tuple, str] = {}
    for inst, nodes in instances.items():
        sig = _signature(nodes, inst + ".")
        pattern = _TRAILING_INDEX.sub(".*", inst)
        cls = classes.setdefault(sig, f"{pattern}#{len(classes)}")
        for i, n in enumerate(nodes):
            set_meta(n, layer=LayerTag(inst, cls, i))
    return gm


def layer_instances(gm: fx.GraphModule) -> dict[str, dict[str, list[fx.Node]]]:
    """Layer class -> instance name -> its op nodes, both in execution order."""
    out: dict = {}
    for n in gm.graph.nodes:
        tag = meta_of(n).layer if n.op == "call_function" else None
        if tag is not None:
            out.setdefault(tag.cls, {}).setdefault(tag.layer, []).append(n)
    return out


def layer_counts(gm: fx.GraphModule) -> dict[str, int]:
    """Number of instances of each layer class."""
    seen = defaultdict(set)
    for n in gm.graph.nodes:
        tag = meta_of(n).layer if n.op != "output" else None
        if tag is not None:
            seen[tag.cls].add(tag.layer)
    return {cls: len(v) for cls, v in seen.items()}


_aten = torch.ops.aten
# Attention in one op: its core is the op.
_FUSED_ATTENTION = {_aten.scaled_dot_product_attention.default,
                    _aten._scaled_dot_product_flash_attention.default,
                    _aten._scaled_dot_product_efficient_attention.default,
                    _aten._scaled_dot_product_flash_attention_for_cpu.default}
_MATMULS = {_aten.matmul.default, _aten.bmm.default, _aten.mm.default, _aten.baddbmm.default}


def _from_param(node: fx.Node) -> bool:
    """Whether ``node`` is a parameter, or a chain of one-input ops on one (a transposed weight)."""
    for _ in range(64):
        if node.op == "placeholder":
            role = meta_of(node).role
            return role is not None and role.kind == "param"
        ins = node.all_input_nodes
        if node.op != "call_function" or len(ins) != 1:
            return False
        node = ins[0]
    return False


def attention_cores(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """The attention cores of one layer instance's op nodes (execution order), what Korthikanti et
    al.'s selective recompute runs again: a fused attention op; or, for attention written out, the
    nodes on every path from the scores matmul (q x k, two activations) to the matmul of the
    probabilities with v, the mask, softmax and dropout between them included. Each core is convex (no
    path leaves it and comes back), so one checkpoint can run it."""
    fused = [[n] for n in nodes if n.target in _FUSED_ATTENTION]
    if fused:
        return fused
    mm = [n for n in nodes if n.op == "call_function" and n.target in _MATMULS
          and not any(_from_param(a) for a in n.all_input_nodes)]
    inside = set(nodes)
    cores = []
    for first, last in zip(mm[0::2], mm[1::2]):
        after = _reachable(first, lambda n: n.users, inside)
        before = _reachable(last, lambda n: n.all_input_nodes, inside)
        core = [n for n in nodes if n in after and n in before]
        if core:
            cores.append(core)
    return cores


def _reachable(start, neighbours, inside) -> set:
    """The nodes of ``inside`` reachable from ``start`` (itself included) along ``neighbours``."""
    seen, stack = {start}, [start]
    while stack:
        for m in neighbours(stack.pop()):
            if m in inside and m not in seen:
                seen.add(m)
                stack.append(m)
    return seen
