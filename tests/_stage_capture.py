"""The layout a parallelisation gives every pipeline stage, read as a switch reads it: the model is built on meta and
parallelised once per stage (this process placed on that stage of a probe mesh of fake groups), its placements
captured with Adam's states, and the stages merged into one layout of the whole mesh (buffers left out: the zoo's
analytic specs plan none)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dynatrain.vps import Layout, ParallelConfig


def captured_stage_layout(pcfg: ParallelConfig, build: Callable[[], torch.nn.Module],
                          parallelize: Callable[[torch.nn.Module, object], None]) -> Layout:
    """``build()`` makes the model (on meta), ``parallelize(model, mesh)`` splits and parallelises it for the
    stage of ``mesh`` this process sits on."""
    from dynatrain.switch.capture import BUFFER, capture
    from dynatrain.switch.probe import probe_mesh

    specs, shardings = {}, {}
    for stage in range(pcfg.pp):
        with probe_mesh(pcfg, stage=stage) as mesh:
            with torch.device("meta"):
                model = build()
            parallelize(model, mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for p in model.parameters():  # Adam's state as a step creates it, without running one
                opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                                "exp_avg_sq": torch.zeros_like(p)}
            cap = capture(model, opt, mesh)
        for spec, sh in zip(cap.specs, cap.shardings):
            if cap.param_of[spec.name][1] == BUFFER:
                continue
            assert spec.name not in specs, f"{spec.name} on two stages"
            specs[spec.name], shardings[spec.name] = spec, sh
    names = sorted(specs)
    return Layout.from_shardings([specs[n] for n in names], [shardings[n] for n in names], pcfg)


def assert_stage_boxes_equal(analytic: Layout, captured: Layout, pcfg: ParallelConfig) -> None:
    """The analytic layout names the captured states and gives every position the captured boxes; each state is held
    by one stage's positions at most."""
    assert sorted((s.name, s.shape, s.dtype) for s in analytic.states) == \
        [(s.name, s.shape, s.dtype) for s in captured.states]
    for spec in analytic.states:
        held = 0
        for p in range(pcfg.world_size):
            assert analytic.shards(spec.name, p) == captured.shards(spec.name, p), (pcfg.short(), spec.name, p)
            held += bool(analytic.shards(spec.name, p).boxes)
        assert 0 < held <= pcfg.stage_size
