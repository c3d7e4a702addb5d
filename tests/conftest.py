"""Test order for CI's two pytest-xdist workers (`.ci/run`: `-n 2 --dist loadgroup`).

xdist hands tests out one at a time in collection order, so a long test collected late runs while the
other worker has nothing left: the longest tests go first. Tests that share a module- or session-scoped
fixture get one `xdist_group` mark, so that loadgroup runs them on one worker, which makes the fixture
once."""
from __future__ import annotations

import pytest

# The longest tests of the CI log (`CI=true bash .ci/run`, be66540, 2026-11-27, quiet), longest first.
# A test missing here keeps its place after them; a renamed one only loses its head start. The two
# tests/triton/test_memory.py entries replace that log's LLaMA and GPT-2 cases (not yet timed by CI).
LONGEST_FIRST = [
    "tests/test_planner.py::test_smallest_budget_on_a_two_by_two_mesh_is_feasible_and_proven",
    "tests/test_memory.py::test_every_plan_under_a_budget_predicts_a_peak_within_it",
    "tests/test_plan_optimality.py::test_plan_within_a_tenth_of_a_percent_of_the_exact_optimum[gpt-tiny-True]",
    "tests/triton/test_memory.py::test_triton_predicted_peak_matches_measured_for_llama_on_two_ranks",
    "tests/test_plan_optimality.py::test_plan_within_a_tenth_of_a_percent_of_the_exact_optimum[gpt2-tiny-True]",
    "tests/test_pipeline_parity.py::test_pipeline_parity_four_ranks",
    "tests/test_memory.py::test_two_d_plan_under_a_tight_budget_is_predicted_within_10_percent_on_four_ranks",
    "tests/test_parity.py::test_parity_two_ranks[llama]",
    "tests/triton/test_memory.py::test_triton_predicted_peak_matches_measured_where_the_records_decide_it",
    "tests/test_long_run.py::test_two_hundred_steps_hold_memory_and_collectives_constant",
    "tests/triton/test_models.py::test_gpt2_trains_with_triton_kernels_on_two_ranks",
    "tests/test_memory.py::test_predicted_peak_matches_measured_on_two_ranks[tight-budget]",
    "tests/test_parity.py::test_parity_two_ranks[bert]",
    "tests/test_parity.py::test_parity_two_ranks[gpt]",
    "tests/test_checkpoint.py::test_run_resumes_after_a_rank_dies_under_torchrun",
    "tests/test_offload.py::test_llama2_70b_fits_one_h100_node_by_offloading",
    "tests/triton/test_models.py::test_gpt2_trains_with_triton_kernels_on_one_rank",
    "tests/test_parity.py::test_parity_four_ranks_2d_mesh[llama]",
    "tests/test_checkpoint.py::test_checkpoint_reshards_across_plans_meshes_and_world_sizes",
    "tests/test_memory.py::test_bf16_mixed_and_the_vocab_parallel_loss_predicted_peaks_match_measured_on_two_ranks",
    "tests/test_memory.py::test_smallest_budget_plan_of_zero_3_and_recompute_is_predicted_within_10_percent",
    "tests/test_bad_input.py::test_corrupted_plans_raise_plan_format_error_or_work",
    "tests/test_planner.py::test_infeasible_budget_names_the_smallest_feasible_one",
    "tests/test_memory.py::test_predicted_peak_matches_measured_on_two_ranks[tight-budget-gpt]",
    "tests/test_hf_families.py::test_families_train_with_parity",
    "tests/test_precision.py::test_bf16_mixed_trains_like_eager_autocast_on_four_ranks",
    "tests/test_memory.py::test_predicted_peak_matches_measured_on_two_ranks[tight-budget-zero-2]",
    "tests/test_parity.py::test_parity_four_ranks_2d_mesh[gpt2]",
    "tests/test_memory.py::test_bf16_mixed_zero1_and_zero2_with_sharded_masters_predicted_peaks_match_measured_on_two_ranks",
    "tests/test_precision.py::test_bf16_mixed_bucketed_zero2_and_megatron_x_dp_train_like_eager_autocast_on_four_ranks",
]


def _shared_fixtures(item) -> set[str]:
    """The module- and session-scoped fixtures of the test suite (not pytest's own) that ``item`` uses."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    return {name for name, defs in info.name2fixturedefs.items()
            for d in defs if d.scope in ("module", "session") and d.baseid.startswith("tests")}


def _groups(items) -> list[list]:
    """The items joined, directly or through others, by a shared fixture; each group and its items in
    collection order."""
    parent: dict = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for item in items:
        for name in _shared_fixtures(item):
            parent[find(name)] = find(item.nodeid)
    members: dict = {}
    for item in items:
        members.setdefault(find(item.nodeid), []).append(item)
    return list(members.values())


# tryfirst: xdist's own hook, which reads the marks into the node ids on each worker, runs after this one.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    rank = {nodeid: i for i, nodeid in enumerate(LONGEST_FIRST)}
    # The tests that share a fixture move together, so that a run without xdist still makes it once.
    groups = sorted(_groups(items), key=lambda g: min(rank.get(item.nodeid, len(rank)) for item in g))
    for group in groups:
        fixtures = set().union(*map(_shared_fixtures, group))
        if fixtures:
            name = "+".join(sorted(fixtures))
            for item in group:
                item.add_marker(pytest.mark.xdist_group(name))
    items[:] = [item for g in groups for item in g]
