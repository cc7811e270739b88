"""The start-up line on where the planner runs (``training.step.planning_line``): between steps with
``--epp-plan-between-steps``; in the background otherwise, said to share a core with training where the rank has
fewer than 2 cores of its own (by its CPU affinity where bound, else the host's cores over its ranks)."""

from __future__ import annotations

from megatron_epp.training.step import planning_line


def test_between_steps_says_its_time_is_exposed():
    assert planning_line(True, 2, 2, 2) == ("planning: each global batch between steps (--epp-plan-between-steps), "
                                            "by the first rank of each model replica: its time is exposed")


def test_background_names_the_shared_core_only_where_the_rank_has_under_two_cores():
    shared = "so that thread shares a core with training (--epp-plan-between-steps keeps it out of the steps)"
    two_on_two = planning_line(False, 2, 2, 2)  # this machine: 2 ranks, 2 cores, unbound
    assert two_on_two.startswith("planning: each global batch in a background thread of the first rank")
    assert "this rank has 1 core of its own (2 ranks on the host's 2)" in two_on_two and shared in two_on_two
    assert shared not in planning_line(False, 8, 64, 64)  # a GPU host: 8 cores per rank
    assert shared not in planning_line(False, 1, 2, 2)  # one rank on 2 cores: the planner has the other
    assert "(4 ranks on the host's 6)" in planning_line(False, 4, 6, 6)  # 1.5 cores each
    bound = planning_line(False, 8, 64, 1)  # bound to one core (e.g. srun --cpu-bind=cores, 1 per task)
    assert "this rank has 1 core of its own (its CPU affinity: 1 of the host's 64)" in bound and shared in bound
    assert shared not in planning_line(False, 8, 64, 8)  # bound to 8
