"""`dynatrain join`: add this process to a running elastic job.

It runs the job's command line (given after ``--``, or as the job's launcher stored it), checks it builds the
same model with the same code (registration refuses anything else), gets ready while the job trains, and becomes a
member at the step boundary where the job scales out. Endpoint and token come from the flags or from ``$DYNATRAIN_ENDPOINT`` and
``$DYNATRAIN_TOKEN``, as a torchrun- or SLURM-launched process gets them.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from dynatrain.cli.devices import own_device
from dynatrain.cli.process_flags import add_process_flags
from dynatrain.elastic.manager import JOIN_CHECKPOINT
from dynatrain.runtime.threads import mark_if_unset
from dynatrain.settings import ENDPOINT_ENV, JOIN_ENV, TOKEN_ENV, explicit_or_env


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("join", help="add this process to a running elastic job",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", default=explicit_or_env(None, ENDPOINT_ENV),
                   help=f"HOST:PORT of the job's store (default: ${ENDPOINT_ENV})")
    p.add_argument("--token", default=explicit_or_env(None, TOKEN_ENV), help=f"the job's token (default: ${TOKEN_ENV})")
    p.add_argument("--token-file", help="a file holding the job's token (the launcher writes one)")
    p.add_argument("--device", type=int, default=None,
                   help="the GPU this process trains on, an index among the visible ones (default: $LOCAL_RANK, as "
                        "torchrun gives it, else 0); it becomes the process's only visible GPU, as torchrun's "
                        "workers see theirs")
    add_process_flags(p)
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="after --: the members' command line (e.g. -- fit --config recipe.yaml); optional for a "
                        "job that `dynatrain fit --elastic.*` started, which stores its own")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    from dynatrain.cli.train import run_lightning_cli
    from dynatrain.elastic.store import connect
    from dynatrain.launch.job import JOB_ARGV_KEY

    try:
        token = Path(args.token_file).read_text().strip() if args.token_file else args.token
    except OSError as e:
        raise SystemExit(f"dynatrain join: cannot read --token-file {args.token_file}: {e.strerror}; give the file "
                         f"the job's launcher wrote (runs/.elastic/token), or --token / ${TOKEN_ENV}") from None
    if not args.endpoint or not token:
        raise SystemExit(f"dynatrain join: give --endpoint and --token (or ${ENDPOINT_ENV} and ${TOKEN_ENV})")
    store = connect(args.endpoint, token)
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not argv:
        # store.get would block until its timeout on a job that never stores its command line (torchrun members).
        if not store.check([JOB_ARGV_KEY]):
            raise SystemExit(f"dynatrain join: the job at {args.endpoint} did not store its command line (only "
                             "`dynatrain fit --elastic.*` does): give the members' command after --, e.g. "
                             "dynatrain join --endpoint HOST:PORT --token-file FILE -- fit --config recipe.yaml")
        argv = json.loads(store.get(JOB_ARGV_KEY).decode())
    # This process launches the job's command line in itself: the environment carries the store and the join to the
    # strategy the recipe builds, as the defaults of ElasticConfig.endpoint/token/join (a recipe leaves them unset).
    os.environ.update({ENDPOINT_ENV: args.endpoint, TOKEN_ENV: token, JOIN_ENV: "1"})
    mark_if_unset()  # without OMP_NUM_THREADS, its threads become its share of the host's cores once admitted
    visible = own_device(args.device, os.environ)
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key, None)  # the job gives this process its rank when it admits it
    return run_lightning_cli([*argv, "--trainer.devices", "1", "--ckpt_path", JOIN_CHECKPOINT])
