"""The planner computes with NumPy's huge-page hint off and gives it back as it found it."""

from __future__ import annotations

import threading

import pytest

from dynatrain.planner import pages, plan_switch, schedule
from dynatrain.vps import Layout, ParallelConfig, StateSpec

hook = pages._set_madvise_hugepage
pytestmark = pytest.mark.skipif(hook is None, reason="this NumPy has no huge-page hook")


def _hint() -> bool:
    now = hook(True)
    hook(now)
    return now


@pytest.fixture
def hint_on():
    before = hook(True)
    yield
    hook(before)


def test_the_hint_is_off_inside_and_restored_by_the_outermost_user(hint_on):
    with pages.small_pages():
        assert _hint() is False
        with pages.small_pages():
            assert _hint() is False
        assert _hint() is False  # an inner user leaving does not switch it back on
    assert _hint() is True
    hook(False)
    with pages.small_pages():
        pass
    assert _hint() is False  # off before, off after
    hook(True)
    with pytest.raises(RuntimeError):
        with pages.small_pages():
            raise RuntimeError("a failed plan")
    assert _hint() is True


def test_overlapping_planners_on_two_threads_restore_it_once_both_are_done(hint_on):
    inside, leave_first = threading.Event(), threading.Event()
    seen = []

    def background():
        with pages.small_pages():
            inside.set()
            leave_first.wait(10)
            seen.append(_hint())

    t = threading.Thread(target=background)
    t.start()
    assert inside.wait(10)
    with pages.small_pages():
        leave_first.set()
        t.join(10)
        assert seen == [False] and _hint() is False  # the background planner left; this one still plans
    assert _hint() is True


def test_plan_switch_runs_with_the_hint_off(hint_on, monkeypatch):
    seen = []
    real = schedule.overlaps

    def spy(*args, **kwargs):
        seen.append(_hint())
        return real(*args, **kwargs)

    monkeypatch.setattr(schedule, "overlaps", spy)
    old = Layout.from_config([StateSpec("w", (8, 4))], ParallelConfig(dp_shard=2))
    plan = plan_switch(old, "tp=2")
    assert seen == [False] and _hint() is True
    assert plan.new.config.short() == "tp=2"
