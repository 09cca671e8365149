"""How `DynaTrainStrategy` runs a training step (mixed into the strategy, before Lightning's
`ModelParallelStrategy`).

With pp the schedule of this rank's stages runs the whole step's micro-batches, forward and backward together, when
Lightning hands over the step's last one. With `torch.compile` on, the seconds compilation takes during the first
optimizer step on a new layout (its blocks compile there: they need the moved weights) go into that switch's
`SwitchReport.compile_s`, filled in as the step runs, so the `SwitchLog` flush after its first micro-batch sees them.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from dynatrain.models.compile import compile_seconds
from dynatrain.models.pipeline_split import pipeline_stages
from dynatrain.strategies.fit_loop import accumulating
from dynatrain.strategies.pipeline_runner import PipelineRunner, check_pipeline_module, pipeline_batch, stack_batches


class CompileWatch:
    """Counts the compile seconds of the first optimizer step after each switch into the switch's report."""

    def __init__(self) -> None:
        self.report = None
        self.mark = 0.0

    def on_switch(self, report) -> None:
        self.report, self.mark = report, compile_seconds()
        report.compile_s = 0.0

    def update(self, last: bool = False) -> None:
        if self.report is not None:
            self.report.compile_s = compile_seconds() - self.mark
            if last:
                self.report = None


class StepHooks:
    pipeline: PipelineRunner | None
    compile_watch: CompileWatch | None

    def build_pipeline(self) -> None:
        """The schedule of this rank's stages for the current layout (None without pp); after every switch."""
        pcfg = self.parallel_config
        self.pipeline = None
        if pcfg is None or pcfg.pp == 1:
            return
        module = self.lightning_module
        check_pipeline_module(module)
        stages = pipeline_stages(module)
        if stages is None:
            raise ValueError(f"layout {pcfg.short()} has pp={pcfg.pp}, but the module's parallelisation split no "
                             "model into stages: see docs/pipeline.md")
        self.pipeline = PipelineRunner(stages, self.device_mesh, self.parallelism.pipeline_schedule,
                                       module.pipeline_loss, self.root_device,
                                       getattr(module, "loss_context", nullcontext),
                                       getattr(module, "on_pipeline_shapes_inferred", None))

    def training_step(self, *args, **kwargs):
        runner = self.pipeline
        if runner is None:
            return super().training_step(*args, **kwargs)
        # Lightning hands over one micro-batch at a time; the schedule runs the step's micro-batches together.
        runner.pending.append(args[0])
        if accumulating(self.lightning_module.trainer):
            return torch.zeros((), device=self.root_device)
        batches, runner.pending = runner.pending, []
        module, trainer = self.lightning_module, self.lightning_module.trainer
        for optimizer in self.optimizers:
            module.optimizer_zero_grad(trainer.current_epoch, args[1] if len(args) > 1 else 0, optimizer)
        inputs, target = stack_batches(batches)
        loss, losses = runner.train_step(inputs, target, len(batches))
        self._compile_seen()
        hook = getattr(module, "on_pipeline_losses", None)
        if hook is not None:
            hook(losses, target)
        return loss

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        if self.pipeline is not None:
            return closure_loss  # the schedule ran backward with the forward
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        self._compile_seen()
        return out

    def optimizer_step(self, *args, **kwargs):
        out = super().optimizer_step(*args, **kwargs)
        self._compile_seen(last=True)
        return out

    def _compile_seen(self, last: bool = False) -> None:
        if self.compile_watch is not None:
            self.compile_watch.update(last)

    def validation_step(self, *args, **kwargs):
        runner = self.pipeline
        if runner is None:
            return super().validation_step(*args, **kwargs)
        loss = runner.evaluate(*pipeline_batch(args[0]))
        module = self.lightning_module
        hook = getattr(module, "on_pipeline_validation_loss", None)
        if hook is not None:
            hook(loss)
        else:
            module.log("val_loss", loss, sync_dist=True)
        return loss
