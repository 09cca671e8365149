"""What `dynatrain fit` leaves out of its output: lines of the libraries it drives that say nothing about the job.

Each is matched by its exact text, and only in dynatrain's own entry points (the processes `dynatrain fit`, its
elastic members and `dynatrain join` start); a library user's own program sees everything. ``--verbose`` keeps them
all: it sets ``DYNATRAIN_VERBOSE=1``, which carries it to every process the command starts; ``verbose=`` of the
functions below wins over that.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

from dynatrain.settings import VERBOSE_ENV, explicit_or_env

# Lightning's start-up lines, printed again by every process that builds a Trainer (joiners, standby processes).
_INFO = (
    "💡 Tip: For seamless cloud logging and experiment tracking,",
    "💡 Tip: For seamless cloud uploads and versioning,",
    "GPU available: ",
    "TPU available: ",
)
_SEED = re.compile(r"^(\[rank: \d+\] )?Seed set to \d+$")
_WARNINGS = (
    # Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates, once per process.
    "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
    "treespec.is_leaf()` instead.",
    # dynatrain hands LightningCLI the arguments it parsed; sys.argv keeps them too, since Lightning starts its
    # local processes again from sys.argv.
    "LightningCLI's args parameter is intended to run from within Python like if it were from the command line.",
)


class _LibraryLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith(_INFO) or _SEED.match(text))


def take_verbose_flag(argv: list[str]) -> list[str]:
    """``argv`` without ``--verbose``; when it was there, every process of the job is verbose."""
    if "--verbose" in argv:
        os.environ[VERBOSE_ENV] = "1"
    return [a for a in argv if a != "--verbose"]


def is_verbose(verbose: bool | None = None) -> bool:
    """``verbose`` when given, else what ``--verbose`` of the command that started this process said
    (``$DYNATRAIN_VERBOSE=1``)."""
    return bool(explicit_or_env(verbose, VERBOSE_ENV, lambda v: v == "1"))


def quiet_libraries(verbose: bool | None = None) -> None:
    """Leave the library lines above out of this process's output (nothing when verbose: `is_verbose`)."""
    if is_verbose(verbose):
        return
    # wandb's own banner; the job's last lines say where the run is and how to upload it.
    os.environ.setdefault("WANDB_SILENT", "true")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero",
                 "lightning.fabric.utilities.seed"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _LibraryLines) for f in logger.filters):
            logger.addFilter(_LibraryLines())
    for text in _WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(text))


def without_library_lines(text: str, verbose: bool | None = None) -> str:
    """``text`` (processes' logs) less the library lines above, so that what failed stands out (nothing when
    verbose: `is_verbose`)."""
    if is_verbose(verbose):
        return text
    return "\n".join(line for line in text.splitlines()
                     if not (line.startswith(_INFO) or _SEED.match(line) or line.startswith("💡 Tip:")))
