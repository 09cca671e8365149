"""One rank of a short training run under strategy="dynatrain"; writes its step losses as JSON."""

import argparse
import os
import warnings

import lightning.pytorch as pl

import dynatrain
from dynatrain.launch.local import finish_rank
from dynatrain.data import LlamaDataModule
from dynatrain.lm.causal_lm import LlamaLM
from dynatrain.models.llama import Transformer
from lightning.pytorch.strategies import ModelParallelStrategy

warnings.filterwarnings("ignore")


class PlainLlamaLM(LlamaLM):
    """Holds a ready Transformer and leaves parallelisation to the strategy."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.model = Transformer(self.model_config)
        self.model.init_weights()

    def configure_model(self) -> None:
        pass


# The strategy only skips parallelising when configure_model is not overridden at all.
del PlainLlamaLM.configure_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", default="auto")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--save", default=None, help="save a DCP checkpoint here after the last step")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--strategy", choices=["dynatrain", "lightning"], default="dynatrain",
                    help="lightning: Lightning's ModelParallelStrategy, LlamaLM parallelising on its mesh")
    ap.add_argument("--model", default="debug")
    ap.add_argument("--plain-module", action="store_true",
                    help="a module holding a materialised Transformer and no configure_model")
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--schedule", default="1F1B", help="the pipeline schedule when the layout has pp")
    ap.add_argument("--stages-per-rank", type=int, default=1)
    ap.add_argument("--val-batches", type=int, default=0, help="validate on this many batches after the last step")
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    pl.seed_everything(1234, verbose=False)
    data = LlamaDataModule(seq_len=args.seq_len, global_batch_size=args.global_batch,
                           micro_batch_size=args.micro_batch, max_corpus_bytes=400_000)
    module_cls = PlainLlamaLM if args.plain_module else LlamaLM
    module = module_cls(model=args.model, model_overrides={"n_layers": args.n_layers}, lr=1e-3, warmup_steps=2)
    if args.strategy == "lightning":
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        strategy = dynatrain.DynaTrainStrategy(parallel=args.layout, parallelism={
            "sequence_parallel": args.sequence_parallel, "pipeline_schedule": args.schedule,
            "stages_per_rank": args.stages_per_rank})
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world,
        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=data, ckpt_path=args.resume)
    val = {}
    if args.val_batches:
        trainer.limit_val_batches = args.val_batches
        (metrics,) = trainer.validate(module, datamodule=data, verbose=False)
        val = {"val_loss": metrics["val/loss"], "val_perplexity": metrics["val/perplexity"]}
    if args.save:
        trainer.save_checkpoint(args.save)
    strategy = trainer.strategy
    result = {
        "losses": module.step_losses,
        "layout": str(getattr(strategy, "parallel_config", None)),
        "dp_rank": getattr(strategy, "dp_rank", None),
        "accumulation": trainer.accumulate_grad_batches,
        "global_step": trainer.global_step,
        **val,
    }
    del trainer, module, strategy
    finish_rank(args.out, result)


if __name__ == "__main__":
    main()
