"""Every ``DYNATRAIN_*`` environment variable dynatrain reads, and the explicit argument that overrides it.

A setting that changes what dynatrain does is an argument: an `ElasticConfig` field (so a
``DynaTrainStrategy(elastic=...)`` option), a datamodule or function argument, or a command-line flag. The
environment only carries a value to the processes a launcher starts (dynatrain's launchers, `dynatrain fit`,
`dynatrain join`; a torchrun or SLURM script of yours), which read it as the default of that argument: an argument
given explicitly always wins (`explicit_or_env`; `memory` and `threads`, below this module, apply the same rule
themselves).

`tests/test_settings.py` reads dynatrain's source and fails for a ``DYNATRAIN_*`` variable that is not in `SETTINGS`,
and for an argument named here that does not exist. An argument is named ``module:Qualified.name`` (a parameter of a
function, class or method, or a dataclass field) or ``module --flag`` (a flag of the command that module implements).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Setting:
    env: str
    arguments: tuple[str, ...]  # what overrides the variable; the first is the one to reach for
    doc: str


_SETTINGS = (
    Setting("DYNATRAIN_CACHE",
            ("dynatrain.data.datamodule:LlamaDataModule.cache_dir", "dynatrain.data.corpus:cache_dir.cache",
             "dynatrain.data.corpus:embedded_corpus.cache", "dynatrain.data.corpus:folder_corpus.cache"),
            "where tokenised text is cached (default ~/.cache/dynatrain)"),
    Setting("DYNATRAIN_ELASTIC",
            ("dynatrain.strategies.dynatrain:DynaTrainStrategy.elastic",
             "dynatrain.elastic.manager:ElasticConfig.parse.value"),
            "the launcher's ElasticConfig (JSON) for a strategy created with elastic=None (`dynatrain fit "
            "--elastic.*` sets it); any explicit elastic=, False included, wins whole"),
    Setting("DYNATRAIN_ENDPOINT",
            ("dynatrain.elastic.manager:ElasticConfig.endpoint", "dynatrain.cli.join --endpoint"),
            "HOST:PORT of the elastic job's store"),
    Setting("DYNATRAIN_TOKEN",
            ("dynatrain.elastic.manager:ElasticConfig.token", "dynatrain.cli.join --token",
             "dynatrain.elastic.rendezvous_handler:resolve_token.token_file",
             "dynatrain.cli.join --token-file", "dynatrain.cli.scale --token",
             "dynatrain.callbacks.rescale:ElasticCallback.control"),
            "the elastic job's token (its store), and the default token of ElasticCallback's control endpoint"),
    Setting("DYNATRAIN_JOIN",
            ("dynatrain.elastic.manager:ElasticConfig.join",),
            "'1': this process joins a running elastic job instead of starting one with the others (`dynatrain "
            "join` and the launchers' joiners set it)"),
    Setting("DYNATRAIN_REJOIN",
            ("dynatrain.elastic.manager:ElasticConfig.rejoin",),
            "'1': a `dynatrain fit`/`join` process that leaves the job waits as a standby for the next scale-out "
            "(the launcher with --elastic.standby sets it)"),
    Setting("DYNATRAIN_RDZV",
            ("dynatrain.callbacks.rescale:ElasticCallback.arrivals",
             "dynatrain.callbacks.rescale:ElasticCallback.preemption"),
            "'dynatrain': a worker of torchrun's dynatrain rendezvous backend (its agent sets it): ElasticCallback "
            "admits every ready joiner and takes SIGTERM as the node leaving"),
    Setting("DYNATRAIN_STORE_TOKEN",
            ("dynatrain.elastic.store --token", "dynatrain.elastic.store:start_store.token"),
            "the token of `python -m dynatrain.elastic.store`"),
    Setting("DYNATRAIN_GC_FREEZE",
            ("dynatrain.runtime.memory:freeze_import_time_objects.enabled",
             "dynatrain.cli.process_flags --no-gc-freeze", "dynatrain.cli.process_flags --gc-freeze"),
            "'0': the entry points leave the import-time objects visible to the cycle collector"),
    Setting("DYNATRAIN_HEAP",
            ("dynatrain.cli.process_flags --heap", "dynatrain.runtime.memory:heap_env.heap",
             "dynatrain.launch.local:rank_env.heap", "dynatrain.launch.local:joiner_env.heap", "dynatrain.launch.local:launch_local.heap",
             "dynatrain.launch.local:launch_elastic.heap"),
            "'reuse' (default): the glibc heap settings of the processes dynatrain starts; 'glibc': glibc's own"),
    Setting("DYNATRAIN_THREADS",
            ("dynatrain.elastic.manager:ElasticConfig.split_threads", "dynatrain.runtime.threads:resplit.split"),
            "'split': dynatrain chose this process's intra-op thread count (its launchers mark a process started "
            "without OMP_NUM_THREADS) and splits the host's cores again after every world change"),
    Setting("DYNATRAIN_VERBOSE",
            ("dynatrain.cli.process_flags --verbose", "dynatrain.cli.quiet:quiet_libraries.verbose",
             "dynatrain.cli.quiet:without_library_lines.verbose"),
            "'1': dynatrain's entry points keep the libraries' start-up lines"),
)

SETTINGS: dict[str, Setting] = {s.env: s for s in _SETTINGS}

# The variables' names, for the modules that read them (through `explicit_or_env`) or set them for a process
# they start.
CACHE_ENV = "DYNATRAIN_CACHE"
ELASTIC_ENV = "DYNATRAIN_ELASTIC"
ENDPOINT_ENV = "DYNATRAIN_ENDPOINT"
TOKEN_ENV = "DYNATRAIN_TOKEN"
JOIN_ENV = "DYNATRAIN_JOIN"
REJOIN_ENV = "DYNATRAIN_REJOIN"
STORE_TOKEN_ENV = "DYNATRAIN_STORE_TOKEN"
FREEZE_ENV = "DYNATRAIN_GC_FREEZE"
HEAP_ENV = "DYNATRAIN_HEAP"
THREADS_ENV = "DYNATRAIN_THREADS"
VERBOSE_ENV = "DYNATRAIN_VERBOSE"
RDZV_ENV = "DYNATRAIN_RDZV"
RDZV_BACKEND = "dynatrain"  # torchrun's --rdzv-backend name, and the value its agent gives RDZV_ENV


def explicit_or_env(value: T | None, name: str, parse: Callable[[str], T] = str,
                    env: Mapping[str, str] | None = None) -> T | None:
    """The precedence of every setting: ``value`` when the caller gave one (not None), else ``$name`` from ``env``
    (default this process's environment) through ``parse``, else None (unset or empty)."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not in dynatrain.settings.SETTINGS: name the argument that overrides it there")
    if value is not None:
        return value
    raw = (os.environ if env is None else env).get(name)
    return parse(raw) if raw else None
