"""The supported Lightning range: the check accepts the installed release and refuses one outside the range with a
message that says what to do; pyproject.toml, the Makefile's LIGHTNING_MIN and dynatrain.runtime.lightning_version agree."""

from __future__ import annotations

import re
from pathlib import Path

import lightning
import pytest

from dynatrain.runtime import lightning_version
from dynatrain.runtime.lightning_version import (LIGHTNING_BELOW, LIGHTNING_MIN, UnsupportedLightningError,
                                         check_lightning_version)

ROOT = Path(__file__).resolve().parent.parent


def _pyproject_lightning_requirement() -> str:
    # A regex, not tomllib: pyproject.toml admits Python 3.10, which has no tomllib.
    [req] = re.findall(r'^\s*"(lightning\s*[<>=!~][^"]*)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    return req


def test_the_installed_lightning_is_accepted():
    assert check_lightning_version() == lightning.__version__


@pytest.mark.parametrize("version", [LIGHTNING_MIN, "2.6.6", "2.6.99", "2.6.1rc1", "2.6.0.post1"])
def test_releases_inside_the_range_are_accepted(monkeypatch, version):
    monkeypatch.setattr(lightning, "__version__", version)
    assert check_lightning_version() == version


@pytest.mark.parametrize("version", ["2.4.0", "2.5.6", "2.6.0rc1", LIGHTNING_BELOW, "2.7.0rc1", "2.7.1", "3.0.0",
                                     "not-a-version"])
def test_releases_outside_the_range_are_refused_with_the_range_and_the_fix(monkeypatch, version):
    monkeypatch.setattr(lightning, "__version__", version)
    with pytest.raises(UnsupportedLightningError) as info:
        check_lightning_version()
    assert isinstance(info.value, RuntimeError)
    message = str(info.value)
    assert f"lightning {version} is installed" in message
    assert f">={LIGHTNING_MIN},<{LIGHTNING_BELOW}" in message
    assert f"pip install 'lightning>={LIGHTNING_MIN},<{LIGHTNING_BELOW}'" in message


def test_pyproject_admits_exactly_the_supported_range():
    req = _pyproject_lightning_requirement()
    assert req.replace(" ", "") == lightning_version.LIGHTNING_REQUIREMENT, (
        f"pyproject.toml says {req!r}, dynatrain/runtime/lightning_version.py {lightning_version.LIGHTNING_REQUIREMENT!r}")


def test_the_makefiles_lightning_min_is_pyprojects_lower_bound():
    [make_min] = re.findall(r"^LIGHTNING_MIN\s*:?=\s*(\S+)\s*$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    [lower] = re.findall(r">=\s*([0-9][0-9.]*)", _pyproject_lightning_requirement())
    assert make_min == lower == LIGHTNING_MIN, (make_min, lower, LIGHTNING_MIN)


def test_the_lowest_release_is_a_pinnable_release_of_an_older_minor_than_the_bound():
    # `make test-lightning-min` installs lightning==LIGHTNING_MIN: a full release, below the excluded next minor.
    assert re.fullmatch(r"\d+\.\d+\.\d+", LIGHTNING_MIN) and re.fullmatch(r"\d+\.\d+", LIGHTNING_BELOW)
    assert tuple(map(int, LIGHTNING_MIN.split("."))) < tuple(map(int, LIGHTNING_BELOW.split(".")))


def test_the_strategy_refuses_an_unsupported_lightning_when_it_is_made(monkeypatch):
    import lightning

    import dynatrain

    monkeypatch.setattr(lightning, "__version__", "2.7.0")
    with pytest.raises(UnsupportedLightningError, match=r"lightning 2\.7\.0 is installed.*pip install"):
        dynatrain.DynaTrainStrategy()
