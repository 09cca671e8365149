"""How `DynaTrainStrategy` loads and saves checkpoints (mixed into the strategy, before Lightning's
`ModelParallelStrategy`).

A committed snapshot (or a `Snapshot` directory, meaning its latest committed snapshot) loads into whatever layout
and world the job has now; a process started with `dynatrain join` loads the state its switch brought
(``ckpt_path=JOIN_CHECKPOINT``); a process that left the job saves nothing. Anything else is Lightning's DCP or full
checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from dynatrain.elastic.manager import JOIN_CHECKPOINT


class CheckpointIO:
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None):
        if str(checkpoint_path) == JOIN_CHECKPOINT:
            checkpoint = self.join_checkpoint()
            if checkpoint is None:
                raise ValueError(f"ckpt_path={JOIN_CHECKPOINT!r} is for a process started with `dynatrain join`")
            return checkpoint
        from dynatrain.strategies.snapshot_io import is_committed, latest_snapshot, restore_snapshot

        path = Path(self.broadcast(str(checkpoint_path)))
        if not is_committed(path) and (path / "latest").exists():
            path = latest_snapshot(path) or path  # a Snapshot directory: its latest committed snapshot
        if is_committed(path):
            # A snapshot loads into whatever layout and world this job has; the loop state comes back with it.
            return restore_snapshot(self, self.lightning_module, path)["checkpoint"]
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        if self.detached:
            return  # a process that left holds no state of the job
        super().save_checkpoint(checkpoint, filepath, storage_options)
