"""The budgets' sans-I/O decisions, without sockets or files: which producer
frames enter while the disk is short (`DiskBudget`), and when memory
pauses them and how far it evicts (`MemoryBudget`)."""
import pytest

from rollstream.broker.flow import DiskBudget, MemoryBudget

BUDGET, RESERVE, PLENTY = 1000, 100, 10_000


def test_under_budget_everything_enters():
    disk = DiskBudget(BUDGET, RESERVE)
    assert not disk.update(500, PLENTY, drainable=True)
    assert disk.everything
    assert all(disk.lets_in(kind, is_open) for kind in ("turn", "end", "abort") for is_open in (True, False))


def test_over_budget_only_new_trajectories_wait_while_consumers_can_drain():
    disk = DiskBudget(BUDGET, RESERVE)
    assert disk.update(1001, PLENTY, drainable=True)
    assert not disk.everything
    assert not disk.lets_in("turn", trajectory_open=False)
    assert disk.lets_in("turn", trajectory_open=True)  # its end can then follow: a batch can complete
    assert disk.lets_in("end", trajectory_open=True) and disk.lets_in("abort", trajectory_open=True)
    assert disk.refusal().startswith("over the disk budget: 1001 bytes on disk, budget 1000;")
    assert "bring it to 900" in disk.refusal()


def test_over_budget_with_nothing_to_drain_new_trajectories_enter():
    """Nothing ready or leased: only producer frames can lead to space being
    freed (ended trajectories are what consumers take), so none waits."""
    disk = DiskBudget(BUDGET, RESERVE)
    disk.update(1500, PLENTY, drainable=False)
    assert disk.everything
    disk.update(1500, PLENTY, drainable=True)
    assert not disk.new_trajectories
    disk.update(1500, PLENTY, drainable=False)
    assert disk.everything


def test_new_trajectories_resume_below_ninety_percent():
    disk = DiskBudget(BUDGET, RESERVE)
    disk.update(1200, PLENTY, drainable=True)
    assert not disk.update(950, PLENTY, drainable=True)  # under the budget, not yet under 90%
    assert not disk.new_trajectories
    assert disk.update(900, PLENTY, drainable=True)
    assert disk.everything


def test_below_the_reserve_no_turn_enters_but_ends_and_aborts_do():
    disk = DiskBudget(BUDGET, RESERVE)
    assert disk.update(10, 99, drainable=False)
    assert not disk.lets_in("turn", trajectory_open=True) and not disk.lets_in("turn", trajectory_open=False)
    assert disk.lets_in("end", trajectory_open=True) and disk.lets_in("abort", trajectory_open=True)
    assert disk.refusal().startswith("the disk is short of space: 99 bytes free, and the broker keeps 100 in reserve")
    assert not disk.update(10, 105, drainable=False)  # above the reserve, not yet above 110% of it
    assert disk.update(10, 110, drainable=False)
    assert disk.everything


def test_a_reserve_of_zero_never_holds_turns_back():
    disk = DiskBudget(BUDGET, 0)
    disk.update(10, 0, drainable=True)
    assert disk.everything


@pytest.mark.parametrize("budget, reserve", [(0, 10), (10, -1)])
def test_nonsense_limits_are_refused(budget, reserve):
    with pytest.raises(ValueError, match="at least"):
        DiskBudget(budget, reserve)


def test_the_memory_budget_evicts_pauses_and_resumes_with_hysteresis():
    budget = MemoryBudget(1000)
    assert budget.evict_to(1000) is None and budget.update(1000) is None and budget.reading  # at the budget: fine
    assert budget.evict_to(1001) == 900  # over it: evict down to 90%
    assert budget.over(1001) and not budget.over(1000)
    assert budget.update(950) is None  # eviction brought it under the budget: keep reading
    assert budget.update(1200) is False and not budget.reading  # what is left is leased: pause
    assert budget.evict_to(950) == 900  # paused: keep evicting above the resume mark
    assert budget.update(950) is None  # between 90% and 100%: stay paused (no flapping)
    assert budget.evict_to(900) is None and budget.update(900) is True and budget.reading
    with pytest.raises(ValueError, match="max_memory_bytes must be at least 1, got 0"):
        MemoryBudget(0)
