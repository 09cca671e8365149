"""torchrun's rendezvous backend ``dynatrain``: a node that arrives or leaves is an online switch, not a restart.

    torchrun --nnodes 1:4 --nproc-per-node N --rdzv-backend dynatrain --rdzv-endpoint HOST:PORT --rdzv-id JOB train.py

Stock torchrun restarts every worker of every node when its handler reports a waiting node
(`num_nodes_waiting() > 0`) and when a node fails and comes back. This handler never reports one. Instead:

* The agents that arrive first (at least ``--nnodes`` MIN, at most MAX, and those that come within ``last_call``
  seconds once MIN are there) form the job's first round: their workers start the job together as generation 0 of
  dynatrain's elastic world, with torchrun's own ``RANK``/``WORLD_SIZE`` for that world.
* An agent that arrives after the job started gets a round of its own (``WORLD_SIZE`` = its own workers): its
  workers start as joiners (``DYNATRAIN_JOIN=1``), register and get ready while the job trains, and are admitted
  at a step boundary by the job's scale-out (`ElasticCallback`'s arrivals). An agent whose workers failed and that
  torchrun restarts (``--max-restarts``) comes back the same way: its new workers rejoin the running job.
* SIGTERM to an agent (a Kubernetes scale-down, SLURM preemption, ``kill``): torchrun sends it on to the workers,
  which leave at the next step boundary (an online scale-in), and the agent exits with status 0 once they are gone.

The job's store lives at the endpoint, served by the agent on the endpoint's host (as torchrun's c10d backend
serves it): every agent and worker of the job reaches one address that no scheduler renames, and a node that
leaves takes nothing with it but its own processes. The job survives the loss of any node but that one; put the
endpoint on the node least likely to go. The store is guarded by the job's token (``$DYNATRAIN_TOKEN`` or
``--rdzv-conf token_file=PATH``): an agent or worker with another token is refused; without a token only a loopback
endpoint is accepted, since anyone who can reach the port could otherwise join the job.

The handler (`rendezvous_handler`) imports torch's rendezvous package, which loads its out-of-tree handlers (this
entry point among them) when it is first imported: this module imports nothing of torch, so that loading it from
there never meets a half-imported module.
"""

from __future__ import annotations

from dynatrain.settings import RDZV_BACKEND as BACKEND
from dynatrain.settings import RDZV_ENV, explicit_or_env

__all__ = ["BACKEND", "RDZV_ENV", "handler_creator", "launched_by_rendezvous"]


def handler_creator():
    """The ``torchrun.handlers`` entry point: torchrun calls it and registers what it returns as the creator."""
    from dynatrain.elastic.rendezvous_handler import DynaTrainRendezvousHandler

    return DynaTrainRendezvousHandler.from_parameters


def launched_by_rendezvous() -> bool:
    """Whether this process is a worker of this backend (its agent marked it)."""
    return explicit_or_env(None, RDZV_ENV) == BACKEND
