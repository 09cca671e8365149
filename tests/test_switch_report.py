import time

import pytest

from dynatrain.switch.report import PhaseTimer, SwitchReport


def test_time_set_aside_is_kept_out_of_the_phases_and_the_stall():
    timer = PhaseTimer()
    time.sleep(0.02)
    timer.set_aside("boundary_wait", 0.015)  # of those 20 ms, 15 were spent waiting
    timer.lap("plan")
    time.sleep(0.01)
    timer.lap("transfer")
    assert timer.aside == {"boundary_wait": 0.015}
    assert 0.004 <= timer.phases["plan"] < 0.015 and timer.phases["transfer"] >= 0.009
    report = SwitchReport(step=1, old_layout="a", new_layout="b", world_size=2, bytes_total=0, bytes_moved=0,
                          bytes_moved_identity=None, rounds=0, rank_map=[0, 1], peak_bytes=0, peak_bound=0,
                          verified=None, phases=timer.phases, boundary_wait_s=timer.aside["boundary_wait"])
    assert report.stall_s == pytest.approx(sum(timer.phases.values()))
    assert report.as_dict()["boundary_wait_s"] == 0.015
