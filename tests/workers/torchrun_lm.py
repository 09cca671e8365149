"""A user's script as torchrun runs it: a stock Hugging Face causal LM in a plain LightningModule with its own
DataLoader, `strategy="dynatrain"` and no line for elasticity (the dynatrain rendezvous backend adds the callback).

Every rank appends what it trained to ``--out``: rank 0 the global loss of each optimizer step (the mean over the
data-parallel ranks of their micro-batches' losses) with the world size; every rank its pid, step and torchrun's
restart count. Rank 0 reads ``--out/control.json`` at every step and every rank follows it: ``sleep`` seconds per
step (time for a test to add or remove nodes) and ``stop_at`` (the step after which the run ends).
"""

import argparse
import json
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import dynatrain  # noqa: F401  (registers strategy="dynatrain")


class LM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Record(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.losses = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        strategy = trainer.strategy
        self.losses.append(outputs["loss"].item() * trainer.accumulate_grad_batches)
        if getattr(strategy, "detached", False) or not strategy.at_step_boundary():
            return
        local = torch.tensor(sum(self.losses) / len(self.losses), dtype=torch.float64)
        self.losses = []
        loss = strategy.reduce(local, reduce_op="mean").item()
        step, rank = trainer.global_step, trainer.global_rank
        with open(self.out / f"pid-{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "rank": rank, "world": trainer.world_size,
                                "restarts": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
                                "rdzv_rank": os.environ.get("RANK")}) + "\n")
        if rank == 0:
            with open(self.out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": loss, "world": trainer.world_size,
                                    "layout": strategy.parallel_config.short()}) + "\n")
        control = None
        if rank == 0:
            path = self.out / "control.json"
            control = json.loads(path.read_text()) if path.exists() else {}
        control = strategy.broadcast(control)
        if control.get("stop_at") is not None and step >= control["stop_at"]:
            trainer.should_stop = True
        time.sleep(float(control.get("sleep", 0)))

    def on_train_end(self, trainer, pl_module):
        reports = [{"step": r.step, "old": r.old_layout, "new": r.new_layout, "verified": r.verified,
                    "world_from": r.old_world_size, "world_to": r.world_size, "stall": r.phases.get("stall")}
                   for r in trainer.strategy.switch_reports]
        (self.out / f"end-{os.getpid()}.json").write_text(json.dumps({
            "detached": bool(getattr(trainer.strategy, "detached", False)), "step": trainer.global_step,
            "switches": reports}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--accumulate", type=int, default=3)
    ap.add_argument("--parallel", default="auto")
    args = ap.parse_args()
    pl.seed_everything(1234, verbose=False)
    module = LM()
    module.data = torch.randint(0, 256, (1200, 32), generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(strategy=dynatrain.DynaTrainStrategy(parallel=args.parallel), accelerator="cpu",
                         devices=int(os.environ["LOCAL_WORLD_SIZE"]), max_steps=args.max_steps, accumulate_grad_batches=args.accumulate,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(args.out), callbacks=[Record(args.out)])
    trainer.fit(module)


if __name__ == "__main__":
    main()
