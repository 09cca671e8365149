"""The Trainer every benchmark process runs: training only, nothing that writes or prints on the side, and the data
module's own sharding instead of Lightning's sampler (a switch changes the data-parallel world under it)."""

from __future__ import annotations

import lightning.pytorch as pl

from dynatrain.data import LlamaDataModule
from dynatrain.runtime.memory import freeze_import_time_objects

# As `dynatrain fit` does: a switch's collections skip the libraries' objects (see `dynatrain.runtime.memory`).
freeze_import_time_objects()


def bench_trainer(strategy, devices: int, max_steps: int, callbacks: list, accelerator: str = "cpu") -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator=accelerator, devices=devices, max_steps=max_steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=callbacks)


def bench_data(args, corpus_bytes: int = 1_000_000) -> LlamaDataModule:
    """The data of a worker with ``--seq-len``, ``--global-batch`` and ``--micro-batch`` arguments."""
    return LlamaDataModule(seq_len=args.seq_len, global_batch_size=args.global_batch, micro_batch_size=args.micro_batch,
                           max_corpus_bytes=corpus_bytes)
