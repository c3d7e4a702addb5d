"""Errors raised by autopar. Each names what went wrong and what to change."""


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class InfeasiblePlanError(AutoparError):
    """No layout fits the memory budget.

    ``min_feasible_budget`` is the smallest per-device budget (bytes) for which a plan exists, and
    ``largest_consumers`` lists ``(name, bytes)`` of what uses the most memory in that plan.
    ``min_feasible_gap``: where the search stopped at its node limit, the least budget may lie up to
    that fraction below ``min_feasible_budget`` (0 where it is proven least).
    """

    def __init__(self, message, *, memory_budget=None, min_feasible_budget=None, largest_consumers=(),
                 min_feasible_gap=0.0):
        super().__init__(message)
        self.memory_budget = memory_budget
        self.min_feasible_budget = min_feasible_budget
        self.min_feasible_gap = min_feasible_gap
        self.largest_consumers = list(largest_consumers)


class PlanFormatError(AutoparError):
    """A plan file is malformed, of another version, or does not match the model."""


class MeshError(AutoparError):
    """A mesh shape or axis names do not fit the cluster."""


class ShardingError(AutoparError):
    """A layout cannot apply to a tensor: a dim that does not divide, or a dim out of range."""


class CaptureError(AutoparError):
    """The model could not be captured as a graph."""


class ClusterMismatchError(AutoparError):
    """The running process group does not match the ClusterSpec or the Plan."""


class ShapeMismatchError(AutoparError):
    """Inputs have other shapes than the ones the plan was made for."""


class AutoparWarning(UserWarning):
    """A plan is valid but likely not what was meant (a mesh axis that splits no work)."""
