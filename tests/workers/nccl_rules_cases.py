"""The cases of tests/test_nccl_rules.py on two gloo processes under the NCCL rules (installed by
tests/nccl_site/sitecustomize.py). Writes, per rank, ``<out>/rank-<r>.json``: each case and whether the rules refused
it."""

import json
import os
import sys
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _refused(fn) -> str:
    from nccl_rules import NcclRuleError

    try:
        fn()
    except NcclRuleError as e:
        return f"refused: {e}"
    return "passed"


def _exchange(strategy):
    from dynatrain.callbacks.rescale import ElasticCallback
    from dynatrain.signals.agreement import Slot

    callback = ElasticCallback.__new__(ElasticCallback)  # _exchange reads nothing of the callback's own
    slots = callback._exchange(SimpleNamespace(strategy=strategy), Slot(None, False))
    assert len(slots) == dist.get_world_size()


def _p2p(group, rank: int, dtypes=(torch.float32, torch.int64)):
    peer = 1 - rank
    shapes = {torch.float32: 4, torch.int64: 2}  # 16 bytes each: gloo matches by size, the rules by dtype too
    order = dtypes if rank == 0 else dtypes[::-1]
    ops = [dist.P2POp(dist.isend if rank == 0 else dist.irecv, torch.zeros(shapes[d], dtype=d), group=group,
                      group_peer=peer) for d in order]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def run(rank: int, out: str) -> None:
    import dynatrain

    store = dist.FileStore(os.path.join(out, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    dist.barrier()
    # The strategy's own control group, as set-up makes it on every world.
    strategy = dynatrain.DynaTrainStrategy()
    strategy._device = torch.device("cpu")
    strategy.form_control_group()
    fresh = dist.new_group([0, 1])
    formed = dist.new_group([0, 1])
    dist.barrier(group=formed)
    results = {
        # A strategy without a control group: the agreement goes to the default (training) group, as before.
        "agreement_on_training_group": _refused(lambda: _exchange(SimpleNamespace())),
        "agreement_on_control_group": _refused(lambda: _exchange(strategy)),
        "training_traffic_on_control_group": _refused(
            lambda: dist.all_reduce(torch.zeros(1), group=strategy.control_group)),
        # gloo's training group takes CPU tensors (on CUDA, NCCL's takes cuda ones): a meta tensor is refused.
        "wrong_device_on_training_group": _refused(lambda: dist.all_reduce(torch.zeros(1, device="meta"))),
        "p2p_first_on_fresh_group": _refused(lambda: _p2p(fresh, rank)),
        "p2p_after_a_collective_out_of_order": _refused(lambda: _p2p(formed, rank)),
    }
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, **results}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    mp.spawn(run, args=(sys.argv[1],), nprocs=2)
