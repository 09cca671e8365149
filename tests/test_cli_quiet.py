"""`dynatrain fit` leaves the libraries' start-up lines out by their exact text, and `--verbose` keeps them."""

import logging
import warnings

import pytest

from _launch import python_path
from dynatrain.cli import quiet


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.setenv(quiet.VERBOSE_ENV, "0")  # restored (unset) afterwards, whatever a test sets
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    before = [list(lg.filters) for lg in loggers]
    for lg in loggers:  # an earlier test may have run dynatrain's entry point in this process
        lg.filters[:] = [f for f in lg.filters if not isinstance(f, quiet._LibraryLines)]
    with warnings.catch_warnings():
        yield loggers
    for lg, filters in zip(loggers, before):
        lg.filters[:] = filters


def _shown(logger, text: str) -> bool:
    record = logger.makeRecord(logger.name, logging.INFO, __file__, 0, text, (), None)
    return all(f.filter(record) for f in logger.filters)


def test_library_lines_go_and_the_job_lines_stay(clean):
    pl, fabric = clean
    quiet.quiet_libraries()
    assert not _shown(pl, "GPU available: False, used: False")
    assert not _shown(fabric, "[rank: 3] Seed set to 1234")
    assert not _shown(pl, "💡 Tip: For seamless cloud logging and experiment tracking, try installing litlogger")
    assert _shown(pl, "Seed set to 1234 and more")  # not the exact line
    assert _shown(pl, "`Trainer.fit` stopped: `max_steps=60` reached.")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        quiet.quiet_libraries()  # the filters go in front of "default"
        warnings.warn(quiet._WARNINGS[0], DeprecationWarning)
        warnings.warn("something else is deprecated", DeprecationWarning)
    assert [str(w.message) for w in seen] == ["something else is deprecated"]


def test_verbose_keeps_everything(clean, monkeypatch):
    assert quiet.take_verbose_flag(["fit", "--verbose", "--config", "x.yaml"]) == ["fit", "--config", "x.yaml"]
    assert quiet.os.environ[quiet.VERBOSE_ENV] == "1"
    pl, _ = clean
    quiet.quiet_libraries()
    assert _shown(pl, "GPU available: False, used: False")


def test_the_argument_wins_over_the_environment(clean, monkeypatch):
    pl, _ = clean
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    quiet.quiet_libraries(verbose=False)
    assert not _shown(pl, "GPU available: False, used: False")
    assert quiet.without_library_lines("GPU available: False, used: False\nok", verbose=False) == "ok"
    monkeypatch.setenv(quiet.VERBOSE_ENV, "0")
    assert quiet.without_library_lines("GPU available: False\nok", verbose=True) == "GPU available: False\nok"


def test_a_failed_selfchecks_logs_lose_the_start_up_lines_and_keep_the_error(clean, monkeypatch):
    logs = ("--- rank 0 ---\nGPU available: False, used: False\nTPU available: False, using: 0 TPU cores\n"
            "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]\n"
            "[rank: 0] Seed set to 1234\nValueError: cannot switch to tp=3")
    assert quiet.without_library_lines(logs) == "--- rank 0 ---\nValueError: cannot switch to tp=3"
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    assert quiet.without_library_lines(logs) == logs


def _cli(*args: str):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=python_path(Path(__file__).resolve().parent.parent))
    return subprocess.run([sys.executable, "-m", "dynatrain.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_a_missing_token_file_and_a_missing_recipe_are_named_without_a_traceback():
    join = _cli("join", "--endpoint", "127.0.0.1:1", "--token-file", "/nonexistent/token")
    assert join.returncode == 1 and "Traceback" not in join.stderr
    assert "cannot read --token-file /nonexistent/token: No such file or directory" in join.stderr
    fit = _cli("fit", "--config", "/nonexistent.yaml")
    assert fit.returncode != 0 and "Traceback" not in fit.stderr
    assert "File does not exist: '/nonexistent.yaml'" in fit.stderr and "run: dynatrain fit --help" in fit.stderr
