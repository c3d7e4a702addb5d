"""Lookups over one Plan, shared by explain, diff and the HTML report. Repeated layers share one
decision per position, so ``plan.alternatives`` is keyed by the first instance's node names and
parameter FQNs; the other instances are mapped onto those by position."""
from __future__ import annotations

import re
from collections import Counter, defaultdict

# The outermost indexed module of a parameter FQN: the same rule passes/layers uses to find instances.
_INSTANCE = re.compile(r"^(.*?\.\d+)\.")


def placeholder_name(fqn: str) -> str:
    """The graph's name for a parameter, which the plan's collectives and alternatives use: torch.export
    names a parameter's placeholder "p_" + its FQN with dots as underscores."""
    return "p_" + fqn.replace(".", "_")


class PlanIndex:
    """Lookups over one plan, built once and shared by every explanation of that plan."""

    def __init__(self, plan):
        self.plan = plan
        self.nodes = {n.name: n for n in plan.nodes}
        self.instances: dict[str, list[str]] = {}          # instance path -> node names, program order
        self.cls_of: dict[str, str] = {}                    # instance path -> layer class
        for n in plan.nodes:
            if n.layer:
                self.instances.setdefault(n.layer, []).append(n.name)
                self.cls_of[n.layer] = n.layer_class
        self.first: dict[str, str] = {}                     # layer class -> its first instance
        for inst, cls in self.cls_of.items():
            self.first.setdefault(cls, inst)
        self.count = Counter(self.cls_of.values())
        self.pos = {name: i for names in self.instances.values() for i, name in enumerate(names)}
        self.param_of = {placeholder_name(f): f for f in plan.params}
        self.colls_at: dict[str, list] = defaultdict(list)
        for c in plan.collectives:
            self.colls_at[c.node].append(c)

    def value_name(self, value: str) -> str:
        return self.param_of.get(value, value)

    def rep_node(self, name: str) -> str:
        """The node at the same position in the first instance of its layer class."""
        layer = self.nodes[name].layer
        if not layer:
            return name
        return self.instances[self.first[self.cls_of[layer]]][self.pos[name]]

    def rep_param(self, fqn: str) -> str:
        m = _INSTANCE.match(fqn)
        if not m or m.group(1) not in self.cls_of:
            return fqn
        return self.first[self.cls_of[m.group(1)]] + fqn[len(m.group(1)):]

    def decision_of(self, name: str) -> str:
        """The alternatives key of the decision that fixes node ``name``'s layout."""
        root = self.nodes[name].follows or name
        if root in self.param_of:
            return self.rep_param(self.param_of[root])
        return self.rep_node(root) if root in self.nodes else root

    def instances_note(self, layer: str) -> str:
        cls = self.cls_of[layer]
        return f"in {layer} (layer class {cls}: {self.count[cls]} instance(s), which share each decision)"
