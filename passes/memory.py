"""What each node keeps alive for backward, measured by running the graph on meta tensors under
``saved_tensors_hooks`` and matching every saved tensor to the graph value whose storage it shares.

Saved tensors are attributed at full size; the cost model scales them by each strategy's layout.
Ops whose target-GPU kernel saves something else than the planning machine's kernel (flash attention
keeps a logsumexp, never the s x s scores) declare ``saved_on_gpu`` in their rule, which wins when the
cluster is CUDA.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.passes.meta import SavedForBackward, meta_of, set_meta
from autopar.passes.rules import rule_for, tensor_inputs


def _storage_key(t: torch.Tensor):
    return t.untyped_storage()._cdata


def _to_meta(v):
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    return v


def saved_activations_pass(gm: fx.GraphModule, *, target_device: str = "cuda") -> fx.GraphModule:
    """Write ``SavedForBackward`` on every call_function node."""
    owner: dict = {}            # storage -> (node, is_param)
    env: dict = {}
    current = {"node": None, "saved": []}

    def pack(t):
        if current["node"] is not None:
            current["saved"].append(t)
        return t

    grad_mode = torch.is_grad_enabled()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                v = _to_meta(node.meta.get("val"))
                role = meta_of(node).role
                if isinstance(v, torch.Tensor) and v.dtype.is_floating_point and role and role.kind == "param":
                    v.requires_grad_(True)
                env[node] = v
                if isinstance(v, torch.Tensor):
                    owner[_storage_key(v)] = (node, role is not None and role.kind == "param")
                continue
            if node.op == "get_attr":
                env[node] = getattr(gm, node.target)
                continue
            if node.op == "output":
                break
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            if "device" in kwargs:                   # factories: keep everything on meta
                kwargs = {**kwargs, "device": torch.device("meta")}
            current["node"], current["saved"] = node, []
            try:
                with torch.enable_grad():
                    out = node.target(*args, **kwargs)
            except (NotImplementedError, RuntimeError):
                # Ops that insist on real data (a higher-order op whose body moves tensors to a device):
                # take the shapes export recorded; such ops run replicated and save nothing we can see.
                out = pytree.tree_map(_to_meta, node.meta.get("val"))
                current["saved"] = []
            finally:
                # A higher-order op that fails inside its no-grad body leaves grad mode off.
                torch.set_grad_enabled(grad_mode)
            current["node"] = None
            env[node] = out
            outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
            if node.target is not operator.getitem:
                for o in outs:
                    owner.setdefault(_storage_key(o), (node, False))
            set_meta(node, saved=_attribute(node, current["saved"], outs, owner, target_device))
    return gm


def _attribute(node, saved, outs, owner, target_device) -> SavedForBackward:
    rule = rule_for(node)
    ins = tensor_inputs(node)
    if target_device == "cuda" and rule.saved_on_gpu is not None and saved:
        from autopar.passes.rules import context_for

        return rule.saved_on_gpu(context_for(node))
    own_keys = {_storage_key(o) for o in outs}
    saved_inputs = [False] * len(ins)
    out_bytes, internal, seen = 0, 0, set()
    for t in saved:
        key = _storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        if key in own_keys:
            out_bytes += t.untyped_storage().nbytes()
            continue
        src = owner.get(key)
        if src is None:
            internal += t.untyped_storage().nbytes()
            continue
        producer, is_param = src
        if is_param:
            continue
        for k, a in enumerate(ins):
            if a is producer or _views_of(a, producer):
                saved_inputs[k] = True
    return SavedForBackward(out_bytes, tuple(saved_inputs), internal)


def _views_of(node: fx.Node, producer: fx.Node) -> bool:
    """Whether ``node`` reads ``producer``'s storage through a chain of single-input nodes."""
    seen = 0
    while node is not producer and seen < 64:
        ins = node.all_input_nodes
        if len(ins) != 1:
            return False
        node = ins[0]
        seen += 1
    return node is producer
