"""`dynatrain fit --elastic.*` end to end: store, members, a standby process started through `dynatrain join`,
a scripted trace that scales out onto it and back in, snapshots across both, the switch log and the loss plot;
and the launcher's bad input."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dynatrain.cli import main
from dynatrain.launch.job import split_elastic_args

REPO = Path(__file__).resolve().parent.parent


def _recipe(tmp_path: Path) -> Path:
    cfg = yaml.safe_load((REPO / "recipes/llama-debug-elastic.yaml").read_text())
    trainer = cfg["trainer"]
    trainer.update(devices=2, max_steps=8, log_every_n_steps=1, default_root_dir=str(tmp_path / "run"))
    trainer["strategy"]["init_args"]["parallel"] = "dp_shard=2"
    elastic = next(c for c in trainer["callbacks"] if c["class_path"].endswith("ElasticCallback"))
    # wait: the scale-out holds training at step 2 until the standby is ready, so the switches below come at steps
    # 2 and 5 however long the standby takes to start (the scale-in decided at step 4 is planned ahead while step 5
    # trains).
    elastic["init_args"].update(trace=[{"step": 2, "devices": 3, "wait": True}, {"step": 4, "devices": 2}],
                                max_devices=3)
    snapshot = next(c for c in trainer["callbacks"] if c["class_path"].endswith("Snapshot"))
    snapshot["init_args"].update(every_n_steps=2, dirpath=str(tmp_path / "snapshots"))
    trainer["logger"] = [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                          "init_args": {"save_dir": str(tmp_path / "run"), "name": "csv"}}]
    cfg["model"]["model_overrides"] = {"n_layers": 2}
    cfg["data"].update(seq_len=64, global_batch_size=12, micro_batch_size=2, max_corpus_bytes=400_000)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _niceness_of_threads(pid: int) -> tuple[int, ...]:
    """The distinct niceness values of a process's threads (field 19 of each /proc/<pid>/task/<tid>/stat)."""
    values = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        values.add(int(Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")[2].split()[16]))
    return tuple(sorted(values))


def _watch_standby_niceness(proc: subprocess.Popen, timeout: float) -> dict[int, list[tuple[int, ...]]]:
    """Until ``proc`` ends: every few tenths of a second, the niceness of each `dynatrain join` process it started."""
    seen: dict[int, list[tuple[int, ...]]] = {}
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("the elastic job did not end")
        for entry in os.listdir("/proc"):
            try:
                if not entry.isdigit() or int(Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[1]) \
                        != proc.pid or b"join" not in Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0"):
                    continue
                seen.setdefault(int(entry), []).append(_niceness_of_threads(int(entry)))
            except (OSError, IndexError, ValueError):
                pass  # it ended meanwhile
        time.sleep(0.25)
    return seen


def _waited_then_trained(samples: list[tuple[int, ...]], normal: int, niced: int) -> bool:
    waiting = samples.index((niced,)) if (niced,) in samples else None
    return waiting is not None and (normal,) in samples[waiting:]


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_elastic_launcher_scales_out_through_a_standby_dynatrain_join(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "dynatrain.cli", "fit", "--config", str(_recipe(tmp_path)),
           "--elastic.max_devices", "3", "--elastic.standby", "1", "--elastic.workdir", str(tmp_path / "elastic"),
           # Niced by 1 only: enough to see, too little to make the test's wait for its standby depend on the load
           # of whatever else runs on the machine.
           "--elastic.standby_nice", "1"]
    log = tmp_path / "out.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
        niceness = _watch_standby_niceness(proc, timeout=380)
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    # The standby waited niced (every thread) and trained at its normal priority once admitted.
    from dynatrain.elastic.priority import restorable

    start = os.getpriority(os.PRIO_PROCESS, 0)
    if start + 1 <= 19 and restorable(start):
        assert any(_waited_then_trained(seen, start, start + 1) for seen in niceness.values()), niceness
    assert "dynatrain join --endpoint" in out
    jsonl = list((tmp_path / "run").rglob("switches.jsonl"))
    assert len(jsonl) == 1, out[-3000:]
    records = [json.loads(line) for line in jsonl[0].read_text().splitlines()]
    assert [(r["step"], r["old_world_size"], r["world_size"]) for r in records] == [(2, 2, 3), (5, 3, 2)]
    assert records[0]["decision"]["request"] == "devices=3 wait"
    assert records[0]["decision"]["standby"] in (0, 1) and records[1]["decision"]["standby"] is None  # the pool
    assert records[1]["decision"]["step"] == 4 and records[1]["prepared"]
    # The process that left at 3 -> 2 stayed as the standby: the launcher never had to start another one.
    assert "left the job; it waits as a standby process" in out, out[-4000:]
    assert out.count("dynatrain elastic job: standby process") == 1, out[-4000:]
    assert all(r["verified"] for r in records)
    # Snapshots are written and committed across both world changes; the last one by the 2 processes left.
    from dynatrain.callbacks.snapshot import latest_snapshot

    assert "snapshot of step" not in out, out[-4000:]
    assert latest_snapshot(tmp_path / "snapshots").name == "step-8"
    assert list((tmp_path / "run").rglob("loss_switches.png"))
    assert "loss: first step" in out


def test_launcher_options_are_checked(capsys):
    assert split_elastic_args(["fit", "--elastic.max_devices=4", "--elastic.standby", "2", "--x", "1"]) == (
        {"max_devices": 4, "standby": 2}, ["fit", "--x", "1"])
    with pytest.raises(ValueError, match="unknown option --elastic.maxdevices"):
        split_elastic_args(["fit", "--elastic.maxdevices", "4"])
    with pytest.raises(ValueError, match="takes a int"):
        split_elastic_args(["fit", "--elastic.standby", "two"])
    assert main(["fit", "--elastic.max_devices", "2", "--elastic.devices", "3"]) == 2
    assert "above --elastic.max_devices 2" in capsys.readouterr().err


def _committed(root: Path, step: int) -> Path:
    path = root / f"step-{step}"
    path.mkdir(parents=True)
    (path / "COMMITTED").write_text("")
    return path


def test_a_failed_job_restarts_from_its_latest_snapshot_on_the_processes_left(tmp_path, monkeypatch):
    from dynatrain.launch.job import ElasticLauncher

    snapshots = tmp_path / "snapshots"
    _committed(snapshots, 2)
    latest = _committed(snapshots, 4)
    (snapshots / "step-6.partial").mkdir()  # half-written: never restarted from
    runs = []

    def fake(outcomes):
        def run_once(self, devices, resume):
            runs.append((devices, resume))
            return outcomes.pop(0)
        return run_once

    launcher = ElasticLauncher({"devices": 4, "restarts": 2}, ["fit"])
    monkeypatch.setattr(ElasticLauncher, "_run_once", fake([(1, 3, str(snapshots)), (0, 3, str(snapshots))]))
    assert launcher.run() == 0
    assert runs == [(4, None), (3, str(latest))]

    # Out of restarts, no snapshot announced, or nobody left: the failure stands.
    for opts, outcomes in [({"devices": 2, "restarts": 0}, [(1, 1, str(snapshots))]),
                           ({"devices": 2}, [(1, 1, None)]),
                           ({"devices": 2}, [(1, 0, str(snapshots))])]:
        runs.clear()
        monkeypatch.setattr(ElasticLauncher, "_run_once", fake(outcomes))
        assert ElasticLauncher(opts, ["fit"]).run() == 1 and len(runs) == 1
    with pytest.raises(ValueError, match="--elastic.restarts must be >= 0"):
        ElasticLauncher({"restarts": -1}, ["fit"])


def test_after_a_failure_the_processes_killed_from_outside_do_not_count(monkeypatch):
    from types import SimpleNamespace

    from dynatrain.launch.job import ElasticLauncher

    def proc(code):
        return SimpleNamespace(poll=lambda: code, returncode=code)

    launcher = ElasticLauncher({"devices": 4, "timeout": 1}, ["fit"])
    # killed (SIGKILL), stopped with an error, exited cleanly, a standby process
    launcher.procs = {1: (proc(-9), "member"), 2: (proc(1), "member"), 3: (proc(0), "member"), 4: (proc(1), "standby")}
    assert launcher._wind_down() == 2


def test_a_restart_command_line_is_one_lightning_accepts(capsys):
    """What the launcher adds for a restart: the snapshot to resume from, and a layout for the processes left."""
    recipe = str(REPO / "recipes/llama-debug-elastic.yaml")
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", recipe, "--trainer.devices", "3", "--ckpt_path", "runs/snapshots",
              "--trainer.strategy.init_args.parallel", "auto", "--print_config"])
    assert done.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["strategy"]["init_args"]["parallel"] == "auto"
    assert printed["ckpt_path"] == "runs/snapshots" and str(printed["trainer"]["devices"]) == "3"


def test_join_without_a_stored_command_line_says_to_give_it(tmp_path):
    # A job whose members torchrun started stores no command line: `dynatrain join` must say so at once instead
    # of blocking on the store until its timeout.
    from dynatrain.elastic.store import start_store

    store = start_store("t0ken", tmp_path, host="127.0.0.1")
    try:
        with pytest.raises(SystemExit, match=r"did not store its command line .* -- fit --config recipe.yaml"):
            main(["join", "--endpoint", store.endpoint, "--token", "t0ken"])
    finally:
        store.stop()
