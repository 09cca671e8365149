"""Flags of the commands that start processes (``fit``, ``validate``, ``test``, ``join``, ``selfcheck``): settings of
every process the command starts, not of the recipe.

Each is taken out of the command line (`take_process_flags`, before anything else runs: glibc reads the heap settings
only at start-up) and put in this process's environment, which carries it to every process the command starts
(Lightning's local ranks, an elastic job's members and standby processes, selfcheck's ranks). A flag wins over what
the environment had; the environment alone is only how a launcher hands the value on (`dynatrain.settings`).
"""

from __future__ import annotations

import argparse
import os

from dynatrain.runtime.memory import HEAP_CHOICES
from dynatrain.settings import FREEZE_ENV, HEAP_ENV, VERBOSE_ENV

# flag -> (the variable it sets, the value, help)
SWITCHES = {
    "--verbose": (VERBOSE_ENV, "1", "keep the libraries' start-up lines in every process's output"),
    "--no-gc-freeze": (FREEZE_ENV, "0", "leave the import-time objects visible to the cycle collector (every full "
                                        "collection of a switch then scans them: about 0.15 s each)"),
    "--gc-freeze": (FREEZE_ENV, "1", "freeze the import-time objects before training (the default)"),
}
HEAP_HELP = ("the processes' heap: 'reuse' (the default) serves PyTorch's large blocks from a glibc heap that keeps "
             "them; 'glibc' keeps glibc's own settings")
HELP = ("Every command that starts processes (fit, validate, test, join, selfcheck) also takes --verbose, "
        "--heap {reuse,glibc} and --no-gc-freeze, for every process it starts.")


def _apply(flag: str, value: str | None = None) -> None:
    if flag == "--heap":
        if value not in HEAP_CHOICES:
            raise ValueError(f"--heap {value!r}: use 'reuse' (the default: serve PyTorch's blocks from a heap that "
                             f"keeps them) or 'glibc' (glibc's own settings)")
        os.environ[HEAP_ENV] = value
    else:
        env, setting, _ = SWITCHES[flag]
        os.environ[env] = setting


def take_process_flags(argv: list[str]) -> list[str]:
    """``argv`` without the flags above (``--heap VALUE`` or ``--heap=VALUE``), each applied to this process's
    environment; a bad ``--heap`` raises ValueError."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name == "--heap":
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError("--heap needs a value: 'reuse' or 'glibc'")
                i += 1
                value = argv[i]
            _apply("--heap", value)
        elif arg in SWITCHES:
            _apply(arg)
        else:
            out.append(arg)
        i += 1
    return out


class _ProcessFlag(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        _apply(option_string, values if isinstance(values, str) else None)


def add_process_flags(parser: argparse.ArgumentParser) -> None:
    """The flags above in ``parser``'s help (the command line reaches the parser without them, `take_process_flags`;
    a parser used alone applies them as it parses)."""
    group = parser.add_argument_group("every process this command starts")
    for flag, (_, _, text) in SWITCHES.items():
        group.add_argument(flag, nargs=0, action=_ProcessFlag, help=text)
    group.add_argument("--heap", choices=HEAP_CHOICES, action=_ProcessFlag, help=HEAP_HELP)
