"""`Snapshot`: asynchronous, atomic DCP snapshots; only committed ones are ever found or restored."""

import json
import os
from pathlib import Path

import pytest
import yaml
from _launch import launch

from dynatrain.callbacks import Snapshot
from dynatrain.callbacks.snapshot import MARKER, latest_snapshot, restore_snapshot

REPO = Path(__file__).resolve().parent.parent


def _snapshot_dir(root: Path, name: str, marked: bool) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"not a real checkpoint")
    if marked:
        (d / MARKER).write_text("{}")
    return d


@pytest.mark.parametrize("kwargs, message", [
    ({"every_n_steps": 0}, "every_n_steps=0"),
    ({"every_n_steps": -3}, "every_n_steps=-3"),
    ({"every_n_steps": 2.5}, "every_n_steps=2.5"),
    ({"every_n_steps": "10"}, "every_n_steps='10'"),
    ({"every_n_steps": True}, "every_n_steps=True"),
    ({"every_n_steps": 5, "keep": 0}, "keep=0"),
])
def test_bad_arguments_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError) as e:
        Snapshot(**kwargs)
    assert message in str(e.value)
    assert "e.g." in str(e.value)  # names a valid value


def test_every_n_steps_has_no_default():
    with pytest.raises(TypeError, match="every_n_steps"):
        Snapshot()


def test_only_committed_snapshots_are_found(tmp_path):
    assert latest_snapshot(tmp_path / "missing") is None
    assert latest_snapshot(tmp_path) is None
    _snapshot_dir(tmp_path, "step-10", marked=True)
    _snapshot_dir(tmp_path, "step-20", marked=True)
    # A crash mid-write: the partial directory, even with a marker inside, and an unmarked final-looking one.
    _snapshot_dir(tmp_path, "step-30.partial", marked=True)
    _snapshot_dir(tmp_path, "step-40", marked=False)
    _snapshot_dir(tmp_path, "step-50.old", marked=True)
    assert latest_snapshot(tmp_path) == tmp_path / "step-20"  # no pointer: the newest committed one
    (tmp_path / "latest").write_text("step-10")
    assert latest_snapshot(tmp_path) == tmp_path / "step-10"  # the pointer decides among committed ones
    for bad in ("step-40", "step-30.partial", "step-99", "../step-20", ""):
        (tmp_path / "latest").write_text(bad)
        assert latest_snapshot(tmp_path) == tmp_path / "step-20", bad


def test_restore_refuses_an_uncommitted_snapshot(tmp_path):
    for name, marked in (("step-4", False), ("step-6.partial", True)):
        d = _snapshot_dir(tmp_path, name, marked)
        with pytest.raises(ValueError, match="is not a committed snapshot.*latest_snapshot"):
            restore_snapshot(None, None, d)  # refused before touching any state or process group


def test_snapshots_are_on_in_the_elastic_recipe_only():
    recipes = {p.name: yaml.safe_load(p.read_text()) for p in (REPO / "recipes").glob("*.yaml")}

    def snapshots(cfg):
        return [c for c in cfg["trainer"].get("callbacks", []) if c["class_path"].endswith(".Snapshot")]

    found = snapshots(recipes.pop("llama-debug-elastic.yaml"))
    assert len(found) == 1 and found[0]["class_path"] == "dynatrain.callbacks.Snapshot"
    cb = Snapshot(**found[0]["init_args"])
    assert cb.every_n_steps == 10 and cb.async_save and "llama-debug-elastic" in str(cb.dirpath)
    assert not any(snapshots(cfg) for cfg in recipes.values())


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_async_snapshots_survive_a_failed_write_guard_a_switch_and_restore_bitwise_into_other_layouts(tmp_path):
    # 2 processes on dp_shard=2, a snapshot every 2 steps. Rank 1's write of step 2 fails, and training waits for
    # that write to end before step 3. A switch to tp=2 runs at step 4's boundary, right after step 4's snapshot
    # started, whose writes are held until the switch calls its guards. After fit: step 4 (saved on dp_shard=2)
    # is restored into tp=2, and step 6 (saved on tp=2) into dp_shard=2.
    snaps = tmp_path / "snaps"
    results = launch("snapshot.py", 2, [
        "--dir", str(snaps), "--switch", "3:tp=2", "--settle", "2", "--fail-write", "2:1",
        "--reference", "4", "--restore", "4:tp=2;6:dp_shard=2"], tmp_path)
    for res in results:
        history = res["history"]
        # Both ranks agree at the next boundary, without waiting, that step 2 was not committed (rank 0's own
        # write had succeeded); training went on.
        assert [(h["step"], h["committed"]) for h in history] == [(2, False), (4, True), (6, True)], history
        assert (history[0]["by"], history[0]["waited"]) == ("poll", False)
        # The switch's guard waited for the in-flight snapshot of step 4 and committed it before moving state.
        assert res["inflight_at_switch"] == [True]
        assert (history[1]["by"], history[1]["waited"]) == ("switch", True)
        assert history[2]["by"] == "end"
        assert [(r["old_layout"], r["new_layout"], r["step"], r["verified"]) for r in res["reports"]] == [
            ("dp_shard=2", "tp=2", 4, True), ("tp=2", "dp_shard=2", 6, True)]
        # Every rank sees the same directory after a commit: the failed step-2.partial is gone, latest is newest.
        assert res["dirs"] == ["latest", "step-4", "step-6"]
        assert res["latest"] == str(snaps / "step-6")
        assert res["guard_left"] is False  # teardown unregistered the guard
        (r4, r6) = res["restores"]
        assert (r4["into"], r4["meta_layout"], r4["meta_step"], r4["meta_global_step"]) == ("tp=2", "dp_shard=2", 4, 4)
        assert (r6["into"], r6["meta_layout"], r6["meta_step"], r6["meta_world"]) == ("dp_shard=2", "tp=2", 6, 2)
        for r in (r4, r6):
            assert r["differing"] == [], r  # every weight, Adam moment, step and the LR, bit for bit
            assert r["compared"] > 60 and r["has_loops"] and r["has_data"]
    assert (snaps / "step-6" / MARKER).is_file() and (snaps / "latest").read_text() == "step-6"
    meta = json.loads((snaps / "step-4" / "snapshot.json").read_text())
    assert meta["checkpoint"]["lr_schedulers"] and meta["checkpoint"]["loops"]["fit_loop"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sync_snapshots_prune_and_clear_leftovers_of_an_earlier_run(tmp_path):
    # Leftovers: a crashed write at the very step this run writes first (with a stale marker inside), one at a
    # later step, an unmarked directory, and a committed snapshot of an abandoned longer run.
    snaps = tmp_path / "snaps"
    _snapshot_dir(snaps, "step-2.partial", marked=True)
    _snapshot_dir(snaps, "step-5.partial", marked=False)
    _snapshot_dir(snaps, "step-3", marked=False)
    _snapshot_dir(snaps, "step-9", marked=True)
    (snaps / "latest").write_text("step-9")
    (res,) = launch("snapshot.py", 1, ["--dir", str(snaps), "--layout", "dp_shard=1", "--sync", "--every", "2",
                                       "--keep", "1", "--fail-write", "4:0", "--restore", "6:dp_shard=1"], tmp_path)
    assert [(h["step"], h["committed"], h["by"], h["waited"]) for h in res["history"]] == [
        (2, True, "due", False), (4, False, "due", False), (6, True, "due", False)]
    # keep=1 pruned step 2; the failed step 4 and every leftover are gone.
    assert res["dirs"] == ["latest", "step-6"]
    assert res["latest"] == str(snaps / "step-6")
    assert res["restores"][0]["differing"] == [] and res["restores"][0]["compared"] > 60
    assert sorted(os.listdir(snaps / "step-6")) == [".metadata", MARKER, "__0_0.distcp", "snapshot.json"]
