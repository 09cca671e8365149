#!/usr/bin/env bash
# An elastic dynatrain job under stock torchrun: one agent per node, nodes added and removed while it trains.
#
#   bash torchrun.sh token    once, on a host that sees the shared file system: the job's token
#   bash torchrun.sh first    on each of the first nodes (at least MIN of them, the endpoint's host among them)
#   bash torchrun.sh join     on a node that comes later: its workers join the running job
#
# Run it from a checkout of dynatrain (the recipe path below is relative to it), with the same values on every
# node. A node leaves by SIGTERM to its torchrun (`kill`, a scheduler's preemption): its workers leave at the next
# step boundary and torchrun exits 0; the others train on.
set -euo pipefail

# The agent on the endpoint's host serves the job's store: the job survives the loss of any node but that one, so
# name the node least likely to go away (not a spot or preemptible node). The port must be free on it and reachable
# from every node.
ENDPOINT=${ENDPOINT:-node-a:29400}
# The rendezvous id and the token keep two jobs apart: an agent with another id or token is refused by the store.
RDZV_ID=${RDZV_ID:-llama-1b-elastic}
# Readable by every node of the job and by nobody else: whoever has the token can join the job.
TOKEN_FILE=${TOKEN_FILE:-/shared/dynatrain/llama-1b-elastic.token}
# MIN nodes start the job; MAX bounds it. Nodes that arrive within last_call seconds once MIN are there start with
# the first ones instead of joining a few steps later (each join is a switch).
NNODES=${NNODES:-2:4}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
# A node that leaves keeps training until the next step boundary, then hands its shards on: give it a step plus a
# switch before torchrun kills its workers. The scheduler's grace (Kubernetes terminationGracePeriodSeconds, SLURM
# GraceTime/KillWait) must be longer still.
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-240}

case "${1:-}" in
token)
    # Without a token the backend accepts a loopback endpoint only (one host): a job across hosts needs one.
    mkdir -p "$(dirname "$TOKEN_FILE")"
    (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TOKEN_FILE")
    ;;
first | join)
    # first: on each of the first nodes; join: on a node that comes later. The command line is the same: the
    # backend tells them apart. A later agent finds the job running; its workers get ready while the job trains and
    # are admitted at a step boundary, and no worker already in the job restarts. A worker that fails is restarted
    # by torchrun (--max-restarts) and rejoins the running job the same way.
    # parallel=auto: pure FSDP over whatever world the first nodes make (the layout policy plans each change after).
    # The global batch is one that 2, 3 and 4 nodes can all keep (16, 24 or 32 data-parallel ranks x micro-batches of
    # 4, accumulated): a world where data-parallel size x micro-batch does not divide it cannot keep the batch.
    torchrun \
        --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
        --rdzv-backend dynatrain --rdzv-endpoint "$ENDPOINT" --rdzv-id "$RDZV_ID" \
        --rdzv-conf "token_file=$TOKEN_FILE,last_call=30" \
        --max-restarts 3 --shutdown-timeout "$SHUTDOWN_TIMEOUT" \
        -m dynatrain.cli fit --config recipes/llama-1b.yaml \
        --trainer.strategy.init_args.parallel auto --data.global_batch_size 384
    ;;
*)
    echo "usage: $0 token|first|join" >&2
    exit 2
    ;;
esac
