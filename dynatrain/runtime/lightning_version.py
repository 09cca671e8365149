"""The Lightning releases dynatrain supports, and the check that the installed one is among them.

dynatrain patches Lightning internals (the epoch loop's step accounting, the fit loop's batch limits, the loop state
a joiner receives; docs/lightning.md lists them), which Lightning may change in any minor release. The range below is
what CI tests at both ends: `make test` on the newest release it admits, `make test-lightning-min` on the lowest.
pyproject.toml's `lightning` requirement and the Makefile's LIGHTNING_MIN say the same; tests/test_lightning_support.py
checks that they agree with these constants, which are the one place the code reads the range from.

`check_lightning_version` raises `UnsupportedLightningError`, a `RuntimeError`: the check runs when the strategy is set
up, not at import, and an `ImportError` there would be taken by code that catches it to fall back on an optional
package. This module imports Lightning only (and `packaging`, one of Lightning's own requirements), never
`dynatrain.strategies`.
"""

from __future__ import annotations

import lightning
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion

# The lowest release the fit-loop and switch tests pass with (older ones: see docs/lightning.md).
LIGHTNING_MIN = "2.6.0"
# The first release not supported: the next minor, which nobody has tested yet.
LIGHTNING_BELOW = "2.7"
LIGHTNING_SPEC = f">={LIGHTNING_MIN},<{LIGHTNING_BELOW}"
LIGHTNING_REQUIREMENT = f"lightning{LIGHTNING_SPEC}"


class UnsupportedLightningError(RuntimeError):
    """The installed Lightning is outside the range dynatrain supports."""


def lightning_version_supported(version: str) -> bool:
    """Whether `version` is in the supported range, by pip's rules (a pre-release of the upper bound is outside it,
    one of a release inside the range is inside); a string that is no version is outside it."""
    try:
        return SpecifierSet(LIGHTNING_SPEC).contains(version, prereleases=True)
    except InvalidVersion:
        return False


def check_lightning_version() -> str:
    """The installed Lightning's version; raises `UnsupportedLightningError` naming it, the supported range and the
    pip command that installs a supported release when it is outside the range."""
    version = lightning.__version__
    if not lightning_version_supported(version):
        raise UnsupportedLightningError(
            f"dynatrain supports Lightning {LIGHTNING_SPEC}, but lightning {version} is installed: dynatrain patches "
            f"Lightning's loops, which change between minor releases (see docs/lightning.md). Install a supported "
            f"release with: pip install '{LIGHTNING_REQUIREMENT}'"
        )
    return version
