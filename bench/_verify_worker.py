"""One rank of `bench/verify_cost.py`: train, switch through ``--chain``, report each switch."""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402

import dynatrain  # noqa: E402
from _trainer import bench_data, bench_trainer  # noqa: E402
from dynatrain.launch.local import finish_rank  # noqa: E402
from dynatrain.lm.causal_lm import LlamaLM  # noqa: E402


class Chain(pl.Callback):
    """Switch to ``chain[i]`` after optimizer step ``(i + 1) * every``."""

    def __init__(self, chain: list[str], every: int) -> None:
        self.chain, self.every, self.done = chain, every, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        strategy = trainer.strategy
        if (self.done < len(self.chain) and trainer.global_step == (self.done + 1) * self.every
                and strategy.at_step_boundary()):
            strategy.switch(self.chain[self.done])
            self.done += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="125m")
    ap.add_argument("--source", default="dp_shard=4")
    ap.add_argument("--chain", default="dp_shard=2,tp=2;dp_shard=4")
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--no-verify", action="store_true", help="the same switches unchecked")
    args = ap.parse_args()
    chain = args.chain.split(";")
    pl.seed_everything(1234, verbose=False)
    strategy = dynatrain.DynaTrainStrategy(parallel=args.source, switching={"verify_switches": not args.no_verify})
    trainer = bench_trainer(strategy, int(os.environ["WORLD_SIZE"]), args.every * (len(chain) + 1),
                            [Chain(chain, args.every)])
    trainer.fit(LlamaLM(model=args.model, lr=1e-3, warmup_steps=2), datamodule=bench_data(args))
    finish_rank(args.out, {"reports": [r.as_dict() for r in strategy.switch_reports]})


if __name__ == "__main__":
    main()
