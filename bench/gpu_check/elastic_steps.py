"""Part (a): the elastic callback on a few training steps of one process under ``strategy="dynatrain"``, with the
process group's own backend (NCCL on a GPU): the callback agrees on requests at every optimizer-step boundary, the
first thing that met an NCCL-only group (issue 49). Also the step times, page faults and peak memory, which the heap
part (`heap_settings.py`) compares with glibc's heap settings on and off.

    python bench/gpu_check/elastic_steps.py --device cuda --out /tmp/a.json   # 125m, fp32, 4 x 256 tokens
"""

from __future__ import annotations

import math
import resource
import statistics
import time

import common  # noqa: F401 - the repository on the path
import torch


def add_args(ap) -> None:
    ap.add_argument("--model", default=None, help="default: 125m on CUDA, a 2-layer debug model on the CPU")
    ap.add_argument("--steps", type=int, default=None, help="default: 10 on CUDA, 3 on the CPU")


def train(args, device: torch.device) -> dict:
    import lightning.pytorch as pl
    import torch.distributed as dist

    from dynatrain import DynaTrainStrategy
    from dynatrain.callbacks.rescale import ElasticCallback
    from dynatrain.data import LlamaDataModule
    from dynatrain.lm.causal_lm import LlamaLM
    from dynatrain.runtime.memory import freeze_import_time_objects

    cuda = device.type == "cuda"
    model = args.model or ("125m" if cuda else "debug")
    steps = args.steps or (10 if cuda else 3)
    seq_len, batch = (256, 4) if cuda else (32, 2)
    freeze_import_time_objects()

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []
            self.faults: list[int] = []
            self.backends: dict = {}

        def on_train_batch_end(self, trainer, *args) -> None:
            common.sync(device)
            self.marks.append(time.perf_counter())
            self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
            if dist.is_initialized() and not self.backends:
                self.backends["default"] = dist.get_backend()
                control = getattr(trainer.strategy, "control_group", None)  # beside the training backend, where made
                if control is not None:
                    self.backends["control"] = dist.get_backend(control)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    clock = Clock()
    elastic = ElasticCallback(control=False, switch_fixed_seconds=0.0)
    strategy = DynaTrainStrategy(parallel="dp_shard=1")
    trainer = pl.Trainer(strategy=strategy, accelerator="gpu" if cuda else "cpu", devices=1, max_steps=steps + 2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         use_distributed_sampler=False, callbacks=[clock, elastic])
    overrides = {} if cuda else {"n_layers": 2}
    module = LlamaLM(model=model, model_overrides=overrides, warmup_steps=1)
    data = LlamaDataModule(seq_len=seq_len, global_batch_size=batch, micro_batch_size=batch,
                           max_corpus_bytes=max(200_000, 8 * seq_len * batch * (steps + 4)))
    trainer.fit(module, datamodule=data)
    gaps = [b - a for a, b in zip(clock.marks[1:], clock.marks[2:])]  # the first two steps warm up
    losses = [float(x) for x in module.step_losses]
    return {
        "model": model, "seq_len": seq_len, "batch": batch, "steps": trainer.global_step,
        "process_group_backends": clock.backends, "losses": losses,
        "median_step_s": statistics.median(gaps) if gaps else None,
        "step_s_range": [min(gaps), max(gaps)] if gaps else None,
        "minor_faults_per_step": (clock.faults[-1] - clock.faults[1]) / max(len(clock.faults) - 2, 1),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "max_memory_allocated": torch.cuda.max_memory_allocated(device) if cuda else None,
        "max_memory_reserved": torch.cuda.max_memory_reserved(device) if cuda else None,
        "decisions": len(elastic.decisions),
        "checks": {"trained_every_step": trainer.global_step == steps + 2,
                   "losses_finite": bool(losses) and all(math.isfinite(x) for x in losses),
                   "nccl_default_group_on_cuda": not cuda or "nccl" in clock.backends.get("default", ""),
                   "control_group_on_gloo": "gloo" in clock.backends.get("control", "gloo")},
    }


if __name__ == "__main__":
    common.run_part("elastic_steps", __doc__, train, add_args)
