"""One rank of a run that switches once, optionally through a test double of the engine that writes where its plan
says, the plan having been made from a wrong rank map (new positions 0 and 1 swapped): what the switch's check
must catch, since the moved bytes are self-consistent with that plan; or (``--corrupt``) through the real engine
with one byte flipped on rank 1 in the first piece it received of a weight. Writes the check's outcome."""

import argparse
import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl

import dynatrain
from dynatrain import engine
from dynatrain.data import LlamaDataModule
from dynatrain.check.verify import SwitchVerificationError
from dynatrain.launch.local import finish_rank

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a forked rank runs this file without its folder
from corruption import flip_received_byte  # noqa: E402
from dynatrain.lm.causal_lm import LlamaLM
from dynatrain.planner.schedule import plan_switch

warnings.filterwarnings("ignore")


def swapped_transition(plan, rank, src, **kwargs):
    """The engine run on a plan whose new rank map swaps the processes at positions 0 and 1."""
    order = list(plan.new.rank_map)
    order[0], order[1] = order[1], order[0]
    wrong = plan_switch(plan.old, plan.new, rank_map=order)
    return engine.run_transition(wrong, rank, src, **kwargs)


def corrupted_transition(plan, rank, src, **kwargs):
    """The engine's transfer, then on rank 1 one byte of the first received piece of a weight flipped."""
    dst, stats = engine.run_transition(plan, rank, src, **kwargs)
    if rank == 1:
        assert flip_received_byte(plan, rank, dst), "rank 1 received no piece of a weight to corrupt"
    return dst, stats


class SwitchOnce(pl.Callback):
    def __init__(self, target: str) -> None:
        self.target, self.outcome = target, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        strategy = trainer.strategy
        if self.outcome is None and trainer.global_step == 1 and strategy.at_step_boundary():
            try:
                report = strategy.switch(self.target)
                self.outcome = {"verified": report.verified, "phases": report.phases}
            except SwitchVerificationError as e:
                self.outcome = {"error": str(e)}
                trainer.should_stop = True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--wrong", action="store_true")
    ap.add_argument("--corrupt", action="store_true")
    args = ap.parse_args()
    pl.seed_everything(1234, verbose=False)
    strategy = dynatrain.DynaTrainStrategy(parallel="dp_shard=2,tp=2", switching={"rank_map": "identity"})
    if args.wrong:
        strategy.switch_transfer = swapped_transition
    if args.corrupt:
        strategy.switch_transfer = corrupted_transition
    script = SwitchOnce("dp_shard=4")
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, callbacks=[script])
    module = LlamaLM(model="debug", model_overrides={"n_layers": 1}, lr=1e-3, warmup_steps=2)
    data = LlamaDataModule(seq_len=32, global_batch_size=4, micro_batch_size=1, max_corpus_bytes=200_000)
    trainer.fit(module, datamodule=data)
    finish_rank(args.out, {"outcome": script.outcome, "verify_default": strategy.switching.verify_switches})


if __name__ == "__main__":
    main()
