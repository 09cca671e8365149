"""Running a split model's stages with `torch.distributed.pipelining` inside Lightning's loop.

Lightning feeds one micro-batch per ``training_step`` and steps the optimizer after ``accumulate_grad_batches`` of
them. A pipeline needs all of a step's micro-batches at once, so the runner keeps them until the step's last one
and then runs the schedule over them: the micro-batches, and so the global batch, are exactly those of the same
job without pp, and the schedule averages their gradients as Lightning's accumulation would. Backward happens
inside the schedule; the loss Lightning receives is for logging only.

Every rank of a pp group runs the schedule; the loss exists on the last stage and is broadcast over the pp group,
so every rank logs the same number. Validation runs the same stages forward only.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from dynatrain.models.pipeline_split import PipelineStages

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


def check_pipeline_module(module) -> None:
    """A LightningModule trained with pp > 1 says what the last stage's loss is."""
    if not callable(getattr(module, "pipeline_loss", None)):
        raise ValueError(
            f"{type(module).__name__} has no `pipeline_loss(output, target)` method: with pp > 1 the strategy runs "
            "the pipeline schedule itself and needs the loss the last stage computes per micro-batch (see "
            "docs/pipeline.md); add it or use pp=1"
        )


def stack_batches(batches: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, target) of a step's micro-batches stacked along dim 0, the schedule's whole batch."""
    inputs, target = zip(*(pipeline_batch(b) for b in batches))
    return torch.cat(inputs), torch.cat(target)


def pipeline_batch(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, target) of a micro-batch: the first stage takes the inputs, the last stage's loss the target."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch):
        return batch[0], batch[1]
    raise ValueError(f"with pp > 1 a batch must be a pair (inputs, target) of tensors, got {type(batch).__name__}")


def check_schedule(name: str, stages_per_rank: int) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={name!r}: use one of {', '.join(SCHEDULES)}")
    if stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be at least 1, got {stages_per_rank}")
    if (name == "Interleaved1F1B") != (stages_per_rank > 1):
        raise ValueError(f"pipeline_schedule={name!r} with stages_per_rank={stages_per_rank}: Interleaved1F1B runs "
                         "several stages per rank (stages_per_rank >= 2), GPipe and 1F1B one")


class _Stage(PipelineStage):
    """torch's stage, telling the module when the extra forward and backward that infer the shapes between stages
    are over (torch clears their gradients there; a module's own counters, such as a router's token counts, are the
    module's to clear)."""

    def __init__(self, *args, after_inference: Callable[[], None] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._after_inference = after_inference

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        if self._after_inference is not None:
            self._after_inference()


class PipelineRunner:
    """The schedule of one layout's stages on this rank, for a given number of micro-batches per step."""

    def __init__(self, stages: PipelineStages, mesh: DeviceMesh, schedule: str,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device,
                 context: Callable[[], AbstractContextManager] = nullcontext,
                 after_inference: Callable[[], None] | None = None) -> None:
        self.stages = stages
        self.group = mesh.get_group("pp")
        self.pp = mesh["pp"].size()
        ranks = dist.get_process_group_ranks(self.group)
        self.last_rank = ranks[(stages.n_stages - 1) % self.pp]  # global rank of the last stage's process
        self.schedule_name = schedule
        self.loss_fn = loss_fn
        self.context = context  # what the loss's forward and backward run under (loss parallelism, say)
        self.device = device
        self.after_inference = after_inference  # the module's `on_pipeline_shapes_inferred`, where it has one
        self._train: dict[int, object] = {}
        self._eval = None
        self.pending: list = []  # this step's micro-batches so far

    def _stages(self) -> list[PipelineStage]:
        s = self.stages
        return [_Stage(view, stage_index=i, num_stages=s.n_stages, device=self.device, group=self.group,
                       after_inference=self.after_inference)
                for i, view in zip(s.stage_ids, s.views)]

    def _schedule(self, n_microbatches: int):
        sched = self._train.get(n_microbatches)
        if sched is None:
            stages = self._stages()
            if len(stages) > 1:
                rounds = max(1, n_microbatches // self.pp)
                cls = ScheduleInterleaved1F1B if n_microbatches % rounds == 0 else ScheduleLoopedBFS
                sched = cls(stages, n_microbatches, loss_fn=self.loss_fn)
            else:
                # 1F1B needs at least as many micro-batches as stages; GPipe computes the same with more memory.
                one_f_one_b = self.schedule_name == "1F1B" and n_microbatches >= self.stages.n_stages
                cls = Schedule1F1B if one_f_one_b else ScheduleGPipe
                sched = cls(stages[0], n_microbatches, loss_fn=self.loss_fn)
            self._train[n_microbatches] = sched
        return sched

    @property
    def is_last(self) -> bool:
        return self.stages.n_stages - 1 in self.stages.stage_ids

    @property
    def is_first(self) -> bool:
        return 0 in self.stages.stage_ids

    def train_step(self, inputs: torch.Tensor, target: torch.Tensor, n_microbatches: int
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Forward and backward of one optimizer step's micro-batches (stacked along dim 0); returns their mean
        loss on every rank of the pp group, and each micro-batch's loss on the last stage (empty elsewhere).

        The loss function also runs once more in the first step of a schedule, where torch infers the shapes
        between stages: only the ``losses`` the schedule reports are the step's."""
        losses: list[torch.Tensor] = []
        sched = self._schedule(n_microbatches)
        args = (inputs,) if self.is_first else ()
        with self.context():
            sched.step(*args, target=target if self.is_last else None, losses=losses, return_outputs=False)
        return self._shared_mean(losses), [loss.detach() for loss in losses]

    def evaluate(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of one batch, forward only, on every rank of the pp group."""
        if self._eval is None:
            stages = self._stages()
            self._eval = ScheduleLoopedBFS(stages, 1, loss_fn=self.loss_fn) if len(stages) > 1 else \
                ScheduleGPipe(stages[0], 1, loss_fn=self.loss_fn)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        with self.context():
            self._eval.eval(*args, target=target if self.is_last else None, losses=losses, return_outputs=False)
        return self._shared_mean(losses)

    def _shared_mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if losses:
            value = torch.stack([loss.detach().float() for loss in losses]).mean()
        else:
            value = torch.zeros((), dtype=torch.float32, device=self.device)
        dist.broadcast(value, src=self.last_rank, group=self.group)
        return value
