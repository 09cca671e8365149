"""How `DynaTrainStrategy` runs Lightning's collectives in a process outside the training world (mixed into the
strategy, before Lightning's `ModelParallelStrategy`): a process that left the job (``detached``) and a joiner
before it trains (``local_only``) answer them alone, as a world of one would."""

from __future__ import annotations


class OutsideWorldCollectives:
    detached: bool
    local_only: bool

    @property
    def outside_world(self) -> bool:
        return self.detached or self.local_only

    def barrier(self, name: str | None = None) -> None:
        if not self.outside_world:
            super().barrier(name)

    def broadcast(self, obj, src: int = 0):
        if self.outside_world:
            return obj
        return super().broadcast(obj, src)

    def reduce(self, tensor, group=None, reduce_op="mean"):
        if self.outside_world:
            return tensor
        return super().reduce(tensor, group, reduce_op)

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        if self.outside_world:
            return tensor.unsqueeze(0)
        return super().all_gather(tensor, group, sync_grads)
