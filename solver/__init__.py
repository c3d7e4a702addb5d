"""The solver stage: picks one option per decision of an abstract layout problem (no torch, no fx)."""
from .brute_force import brute_force
from .greedy import greedy
from .ilp import GAP, solve
from .memory_bound import GUARD_SECONDS, NODE_LIMIT, Fit, MinimumBudget, fits_within, minimum_feasible_budget
from .problem import Choice, Edge, MemoryConstraint, Problem, SharedBytes, SharedEdge, Solution

__all__ = ["GAP", "Problem", "Choice", "Edge", "SharedEdge", "SharedBytes", "MemoryConstraint", "Solution", "solve", "greedy", "brute_force",
           "minimum_feasible_budget", "MinimumBudget", "fits_within", "Fit", "NODE_LIMIT",
           "GUARD_SECONDS"]
