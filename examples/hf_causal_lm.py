"""Bring a Hugging Face model: the README's quick start as a file you can run.

A LightningModule of a dozen lines around a stock `transformers` causal LM, random weights from a config (no
download), with no configure_model() and no line written for dynatrain: the strategy shards it with FSDP2 per
decoder layer (the model's `_no_split_modules`), takes tensor parallelism from the model's own `_tp_plan`, and
switches layouts while it trains.

    pip install transformers        # yours to install: dynatrain does not depend on it
    python examples/hf_causal_lm.py                              # 4 CPU processes, dp_shard=4
    python examples/hf_causal_lm.py --relayout 10:dp_shard=2,tp=2 --relayout 20:dp_replicate=2,dp_shard=2

While it trains, a layout can also come from outside: `dynatrain scale --endpoint ENDPOINT --layout
dp_shard=2,tp=2`, with the endpoint from runs/hf_causal_lm/control.json and the token in
runs/hf_causal_lm/control.token. On a GPU cluster the file is the same: `--accelerator gpu --devices 8
--num-nodes 2 --precision bf16-mixed` under srun or torchrun. Processes that leave and join: docs/elastic.md.
"""

import argparse

import lightning.pytorch as pl
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import dynatrain  # noqa: F401  (registers strategy="dynatrain")
from dynatrain.callbacks import ElasticCallback


class LM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4))  # random weights
    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss
    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randint(0, 256, (512, 32)), batch_size=4)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


class Summary(pl.Callback):
    """What the run did, on rank 0 at the end: its loss, and each switch with its check."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # Lightning divided it by the accumulation, which a switch to fewer data-parallel ranks raises to keep the
        # global batch.
        self.losses.append(outputs["loss"].item() * trainer.accumulate_grad_batches)

    def on_train_end(self, trainer, pl_module):
        if not trainer.is_global_zero:
            return
        strategy = trainer.strategy
        for r in strategy.switch_reports:
            print(f"switch at step {r.step}: {r.old_layout} -> {r.new_layout}, verified={r.verified}")
        print(f"trained {trainer.global_step} steps, now on {strategy.parallel_config.short()}; "
              f"loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--relayout", action="append", default=[], metavar="STEP:LAYOUT",
                    help="switch to LAYOUT after STEP optimizer steps (repeatable)")
    ap.add_argument("--run-dir", default="runs/hf_causal_lm")
    args = ap.parse_args()
    trace = [(int(step), layout) for step, layout in (r.split(":", 1) for r in args.relayout)]
    pl.seed_everything(1234, verbose=False)
    trainer = pl.Trainer(strategy="dynatrain", accelerator=args.accelerator, devices=args.devices,
                         num_nodes=args.num_nodes, precision=args.precision, max_steps=args.max_steps,
                         default_root_dir=args.run_dir, logger=False, enable_checkpointing=False,
                         callbacks=[ElasticCallback(trace=trace, control=True), Summary()])
    trainer.fit(LM())


if __name__ == "__main__":
    main()
