"""`dynatrain fit` leaves the libraries' start-up lines out by their exact text, and `--verbose` keeps them."""

import logging
import warnings

import pytest

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
