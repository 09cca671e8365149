"""One rank of a run with `Snapshot`: optional layout switches during training, then restores checked bitwise.

``--switch STEP:LAYOUT`` requests a switch during step STEP+1, so it runs at the boundary of step STEP+1, right
after that step's snapshot started; that snapshot's writes are held until the switch calls its guards, so it is
surely in flight then. ``--settle STEP``: training waits before the next micro-batch until the snapshot of STEP
finished writing, so a later boundary surely finds it done. ``--fail-write STEP:RANK`` makes one rank's write of
one snapshot fail. ``--reference STEP`` keeps the full weights and Adam state as of the snapshot of STEP;
``--restore STEP:LAYOUT`` after fit switches to LAYOUT, restores the snapshot of STEP and compares it with what
was kept (``STEP`` = the last step compares with the final state).
"""

import argparse
import os
import threading
import warnings

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

import dynatrain
from dynatrain.callbacks.snapshot import Snapshot, latest_snapshot, restore_snapshot
from dynatrain.data import LlamaDataModule
from dynatrain.launch.local import finish_rank
from dynatrain.lm.causal_lm import LlamaLM

warnings.filterwarnings("ignore")


def full_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every weight and Adam state as a full tensor, keyed by parameter name: comparable across layouts."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = _full(p.detach())
        for key, value in optimizer.state.get(p, {}).items():
            out[f"{name}:{key}"] = _full(value)
    for i, group in enumerate(optimizer.param_groups):
        out[f"group{i}:lr"] = torch.tensor(float(group["lr"]), dtype=torch.float64)
    return out


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def differing(a: dict, b: dict) -> list[str]:
    if set(a) != set(b):
        return [f"keys differ: {sorted(set(a) ^ set(b))[:5]}"]
    return [k for k in a if not torch.equal(a[k], b[k])]


SWITCH_STARTED = threading.Event()


class Script(pl.Callback):
    """Runs after `Snapshot` in the callback list: sees each snapshot just after it started."""

    def __init__(self, snap: Snapshot, switch: tuple[int, str] | None, reference: int | None, settle: int | None):
        self.snap, self.switch, self.reference, self.settle = snap, switch, reference, settle
        self.kept: dict | None = None
        self.inflight_at_switch: list[bool] = []

    def on_train_start(self, trainer, pl_module):
        trainer.strategy.switch_guards.insert(0, SWITCH_STARTED.set)  # runs before the snapshot's guard

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        s = self.snap._inflight
        if s is not None and s.step == self.settle:
            s.future.exception()  # wait for the write to end, failed or not
        if self.switch and trainer.global_step == self.switch[0] and not trainer.strategy.switch_pending:
            trainer.strategy.request_switch(self.switch[1])
            self.switch = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        s = self.snap._inflight
        if s is not None and s.step == trainer.global_step and trainer.strategy.switch_pending:
            self.inflight_at_switch.append(not s.future.done())
        if s is not None and s.step == self.reference and self.kept is None:
            self.kept = full_state(pl_module.model, trainer.strategy.optimizers[0])


def patch_writes(hold_step: int | None, fail: str) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    original = FileSystemWriter.write_data
    fail_step, fail_rank = (int(x) for x in fail.split(":")) if fail else (-1, -1)

    def write_data(self, plan, planner):
        if f"step-{hold_step}.partial" in str(self.path):
            assert SWITCH_STARTED.wait(timeout=120), "the switch never called its guards"
        if f"step-{fail_step}.partial" in str(self.path) and int(os.environ["RANK"]) == fail_rank:
            raise OSError(f"disk full (simulated) while writing the snapshot of step {fail_step}")
        return original(self, plan, planner)

    FileSystemWriter.write_data = write_data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layout", default="dp_shard=2")
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--switch", default="")
    ap.add_argument("--settle", type=int, default=None)
    ap.add_argument("--fail-write", default="", help="STEP:RANK: that rank's write of that snapshot fails")
    ap.add_argument("--reference", type=int, default=None)
    ap.add_argument("--restore", default="", help="STEP:LAYOUT;... after fit")
    args = ap.parse_args()
    switch = (int(args.switch.split(":")[0]), args.switch.split(":", 1)[1]) if args.switch else None
    patch_writes(switch[0] + 1 if switch else None, args.fail_write)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pl.seed_everything(1234, verbose=False)
    strategy = dynatrain.DynaTrainStrategy(parallel=args.layout,
                                           switching={"verify_switches": True, "switch_budget_mb": 0.5})
    snap = Snapshot(every_n_steps=args.every, dirpath=args.dir, keep=args.keep, async_save=not args.sync)
    script = Script(snap, switch, args.reference, args.settle)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[snap, script],
    )
    module = LlamaLM(model="debug", model_overrides={"n_layers": 2}, lr=1e-3, warmup_steps=2)
    data = LlamaDataModule(seq_len=64, global_batch_size=4, micro_batch_size=1, max_corpus_bytes=400_000)
    trainer.fit(module, datamodule=data)

    result = {
        "history": snap.history,
        "guard_left": any(getattr(g, "__self__", None) is snap for g in strategy.switch_guards),
        "inflight_at_switch": script.inflight_at_switch,
        "layout": strategy.parallel_config.short(),
        "latest": str(latest_snapshot(args.dir)),
        "dirs": sorted(os.listdir(args.dir)),
        "restores": [],
    }
    final = full_state(module.model, strategy.optimizers[0])
    for item in filter(None, args.restore.split(";")):
        step, layout = item.split(":", 1)
        step = int(step)
        if layout != strategy.parallel_config.short():
            strategy.switch(layout)
        # Training further or switching must not matter: restore over a state that differs everywhere.
        with torch.no_grad():
            for p in module.model.parameters():
                p.add_(1.0)
                for value in strategy.optimizers[0].state.get(p, {}).values():
                    value.add_(1.0)
        meta = restore_snapshot(strategy, module, os.path.join(args.dir, f"step-{step}"))
        want = final if step == trainer.global_step else script.kept
        assert want is not None, f"no reference kept for step {step}"
        result["restores"].append({
            "step": step, "into": strategy.parallel_config.short(), "meta_step": meta["step"],
            "meta_layout": meta["layout"], "meta_world": meta["world_size"],
            "meta_global_step": meta["checkpoint"]["global_step"],
            "has_loops": "fit_loop" in meta["checkpoint"]["loops"],
            "has_data": any(k.endswith("DataModule") for k in meta["checkpoint"]),
            "differing": differing(full_state(module.model, strategy.optimizers[0]), want)[:10],
            "compared": len(want),
        })
    result["reports"] = [r.as_dict() for r in strategy.switch_reports]
    del trainer, module, strategy, final, script
    finish_rank(args.out, result)


if __name__ == "__main__":
    main()
