"""One rank of `bench/plan_ahead.py`: train, request a switch at a step boundary every ``--every`` steps (as
`ElasticCallback` does), with or without ``plan_ahead``; record every step's span and every switch's report."""

from __future__ import annotations

import argparse
import os
import time
import warnings

import lightning.pytorch as pl

import dynatrain
from dynatrain.launch.local import finish_rank
from dynatrain.lm.causal_lm import LlamaLM
from dynatrain.vps.parallel_config import ParallelConfig
from _trainer import bench_data, bench_trainer  # this folder

warnings.filterwarnings("ignore")


class Requests(pl.Callback):
    def __init__(self, chain: list[str], every: int, ahead: bool) -> None:
        self.chain, self.every, self.ahead = chain, every, ahead
        self.next = 1
        self.starts: dict[int, float] = {}
        self.ends: dict[int, float] = {}
        self.requested: list[int] = []
        self.request_s: list[float] = []  # each request_switch call: it checks and builds the target on meta

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.setdefault(trainer.global_step + 1, time.time())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        if not strategy.at_step_boundary():
            return
        step = trainer.global_step
        self.ends[step] = time.time()
        if self.next < len(self.chain) and step == self.next * self.every and not strategy.switch_pending:
            t0 = time.perf_counter()
            strategy.request_switch(self.chain[self.next], plan_ahead=self.ahead)
            self.request_s.append(time.perf_counter() - t0)
            self.requested.append(step)
            self.next += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--chain", required=True)
    ap.add_argument("--every", type=int, required=True)
    ap.add_argument("--ahead", action="store_true")
    ap.add_argument("--model", default="125m")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=2)
    ap.add_argument("--budget-mb", type=float, default=64.0)
    ap.add_argument("--rank-map", default="auto")
    args = ap.parse_args()
    chain = args.chain.split(";")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if ParallelConfig.parse(chain[0]).world_size != world:
        raise SystemExit(f"{chain[0]} does not run on {world} processes")
    pl.seed_everything(1234, verbose=False)
    strategy = dynatrain.DynaTrainStrategy(parallel=chain[0], switching={
        "switch_budget_mb": args.budget_mb, "verify_switches": False, "rank_map": args.rank_map})
    requests = Requests(chain, args.every, args.ahead)
    steps = args.every * len(chain)
    trainer = bench_trainer(strategy, world, steps, [requests])
    module = LlamaLM(model=args.model, lr=1e-3, warmup_steps=2)
    trainer.fit(module, datamodule=bench_data(args))
    result = {"rank": strategy.global_rank, "losses": module.step_losses, "starts": requests.starts,
              "ends": requests.ends, "requested": requests.requested,
              "request_s": requests.request_s,
              "reports": [r.as_dict() for r in strategy.switch_reports]}
    del trainer, module, strategy
    finish_rank(args.out, result)


if __name__ == "__main__":
    main()
