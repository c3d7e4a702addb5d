"""Activation checkpointing in a rank's local program: each layer instance the plan recomputes, and
each attention core it recomputes alone (selective recompute), becomes one call of
``runtime.recompute.checkpointed`` on a submodule that holds its nodes (its ops and the collectives
codegen emitted for them). Each layer instance whose saved activations the plan keeps in host memory
becomes one call of ``runtime.recompute.offloaded`` on such a submodule."""
from __future__ import annotations

import operator

import torch.fx as fx

from autopar.codegen.graph_order import stable_toposort
from autopar.errors import AutoparError
from autopar.passes.meta import meta_of, set_meta
from autopar.passes.runner import requires

@requires("local_program_pass", "layers_pass")
def recompute_pass(gm: fx.GraphModule, *, layers, cores=(), offloaded=()) -> fx.GraphModule:
    """Wrap the nodes of every layer instance in ``layers`` (their ``meta_of(n).layer``) in a checkpoint,
    and the nodes of every attention core in ``cores`` ((region name, planned node names)), with the
    reshardings emitted for them, in one of their own (selective recompute); those of every instance in
    ``offloaded`` in a region whose saved activations live in host memory."""
    from autopar.runtime.recompute import checkpointed, offloaded as to_host

    graph = gm.graph
    for insts, run, what in ((layers, checkpointed, "recomputes"), (offloaded, to_host, "offloads")):
        for inst in insts:
            region = [n for n in graph.nodes if meta_of(n).layer is not None and meta_of(n).layer.layer == inst]
            if not region:
                raise AutoparError(f"the plan {what} layer {inst!r}, which this program does not have; "
                                   f"plan this model again")
            _wrap(gm, region, inst, run)
    for name, nodes in cores:
        names = set(nodes)
        region = [n for n in graph.nodes if meta_of(n).source in names or meta_of(n).reader in names]
        # The reshardings emitted for the core's inputs are in it too; their sources are the inputs'.
        if not names <= {meta_of(n).source for n in region}:
            raise AutoparError(f"the plan recomputes the attention core {name!r} ({sorted(names)[:4]}...), which "
                               f"this program does not have; plan this model again")
        _wrap(gm, region, name, checkpointed)
    graph.lint()
    gm.recompile()
    return gm


def _wrap(gm: fx.GraphModule, region: list, inst: str, run) -> None:
    """Replace ``region`` (nodes in program order) by one call of ``run`` on a submodule of it."""
    graph = gm.graph
    inside = set(region)
    _check_convex(graph, inside, inst)
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    body = fx.Graph()
    env = {a: body.placeholder(a.name) for a in inputs}
    for n in region:
        env[n] = body.node_copy(n, lambda a: env[a])
    body.output(tuple(env[o] for o in outputs))
    kind = "offload" if run.__name__ == "offloaded" else "recompute"
    name = f"{kind}_" + inst.replace(".", "_").replace(":", "_")
    gm.add_submodule(name, fx.GraphModule(gm, body, class_name="Offloaded" if kind == "offload" else "Recomputed"))
    with graph.inserting_after(region[-1]):
        module = graph.get_attr(name)
    with graph.inserting_after(module):
        call = graph.call_function(run, (module, *inputs))
    cursor = call
    for k, o in enumerate(outputs):
        with graph.inserting_after(cursor):
            cursor = graph.call_function(operator.getitem, (call, k))
        if "val" in o.meta:
            cursor.meta["val"] = o.meta["val"]
        set_meta(cursor, layer=meta_of(o).layer)
        o.replace_all_uses_with(cursor, delete_user_cb=lambda u: u not in inside)
    for n in reversed(region):
        graph.erase_node(n)
    stable_toposort(graph)


def _check_convex(graph: fx.Graph, inside: set, inst: str) -> None:
    """One call can replace the region only if no path leaves it and comes back in."""
    tainted = set()          # nodes outside the region that depend on it
    for n in graph.nodes:
        if n in inside:
            back = [a for a in n.all_input_nodes if a in tainted]
            if back:
                raise AutoparError(f"layer {inst!r} cannot be recomputed as one region: {n.name} reads "
                                   f"{back[0].name}, computed outside the layer from its own values; "
                                   f"plan with recompute=False")
        elif any(a in inside or a in tainted for a in n.all_input_nodes):
            tainted.add(n)
