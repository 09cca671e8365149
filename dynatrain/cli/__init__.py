"""The ``dynatrain`` command line.

``dynatrain fit|validate --config recipes/<name>.yaml`` is LightningCLI; the other subcommands are dynatrain's own.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

LIGHTNING_COMMANDS = ("fit", "validate", "test")
OWN_COMMANDS = ("join", "plan", "scale", "selfcheck")  # each a module of dynatrain.cli with add_parser(subparsers)
TRAINING_COMMANDS = (*LIGHTNING_COMMANDS, "join")
PROCESS_COMMANDS = (*TRAINING_COMMANDS, "selfcheck")  # they take the flags of `process_flags`


def _own_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of dynatrain's own subcommands. Given a known ``command``, only that subcommand's module is
    imported: `join` and `selfcheck` pull in torch (seconds), which `dynatrain plan` must not pay for."""
    from dynatrain.cli.process_flags import HELP

    parser = argparse.ArgumentParser(
        prog="dynatrain",
        description="Elastic LLM training on PyTorch Lightning. "
        f"Training: dynatrain {{{','.join(LIGHTNING_COMMANDS)}}} --config RECIPE.yaml (see `dynatrain fit --help`).",
        epilog=HELP,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in (command,) if command in OWN_COMMANDS else OWN_COMMANDS:
        importlib.import_module(f"dynatrain.cli.{name}").add_parser(sub)
    return parser


def _restart_with_heap_settings(argv: list[str]) -> None:
    """Start this command over in the same process with the heap settings of `memory.heap_env` when it was started
    without them: glibc reads them only at start-up, and every process the command starts inherits them."""
    from dynatrain.runtime.memory import heap_env

    env = heap_env(os.environ)
    if env != dict(os.environ):
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "dynatrain.cli", *argv], env)


def main(argv: list[str] | None = None) -> int:
    """The command line. A command that starts processes first takes its process flags (`process_flags`: --verbose,
    --heap, --no-gc-freeze) into the environment those processes inherit; run as the program (``argv`` None), a
    training command then restarts itself with the heap settings if it lacks them."""
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PROCESS_COMMANDS:
        from dynatrain.cli.process_flags import take_process_flags

        try:
            argv = take_process_flags(argv)
            if as_program and argv[0] in TRAINING_COMMANDS:
                _restart_with_heap_settings(argv)
        except ValueError as e:
            print(f"dynatrain {argv[0]}: error: {e}", file=sys.stderr)
            return 2
    if as_program and argv and argv[0] == "join":
        # A standby process: its start-up (torch, Lightning, its Trainer) already runs at low priority.
        from dynatrain.elastic import priority

        priority.lower(priority.launcher_amount())
    if argv and argv[0] in LIGHTNING_COMMANDS and any(a.startswith("--elastic.") for a in argv):
        from dynatrain.launch.job import ElasticLauncher, split_elastic_args

        try:
            opts, rest = split_elastic_args(argv)
            launcher = ElasticLauncher(opts, rest)
        except ValueError as e:
            print(f"dynatrain {argv[0]}: error: {e}", file=sys.stderr)
            return 2
        return launcher.run()
    if argv and argv[0] in LIGHTNING_COMMANDS:
        from dynatrain.cli.train import run_lightning_cli

        return run_lightning_cli(argv)
    parser = _own_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
