"""A switch request's course through the orchestrator's one state machine: checked once at its arrival, replaced
by a later one, refused before anything moved; a transition the machine does not know is an error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dynatrain.models.configs import get_model_config
from dynatrain.strategies.switch_orchestrator import RequestState, SwitchOrchestrator, SwitchRequest
from dynatrain.vps.parallel_config import ParallelConfig


def _orchestrator(world: int = 4) -> SwitchOrchestrator:
    strategy = SimpleNamespace(world_size=world, model_config=lambda: get_model_config("debug"), elastic=None)
    orchestrator = SwitchOrchestrator(strategy)
    orchestrator.trainer = SimpleNamespace(training=True, global_step=3, datamodule=None)  # requests are queued
    return orchestrator


def test_a_request_is_queued_as_requested_and_a_later_one_drops_it():
    orchestrator = _orchestrator()
    orchestrator.request("tp=4")
    first = orchestrator.pending
    assert first.state is RequestState.REQUESTED and first.in_world and first.requested_step == 3
    orchestrator.request("dp_shard=2,tp=2")
    assert first.state is RequestState.DROPPED
    assert orchestrator.pending.target.short() == "dp_shard=2,tp=2"
    assert orchestrator.pending.state is RequestState.REQUESTED


def test_a_refused_request_leaves_the_pending_one_as_it_was():
    orchestrator = _orchestrator()
    orchestrator.request("tp=4")
    pending = orchestrator.pending
    with pytest.raises(ValueError):
        orchestrator.request("tp=3")
    assert orchestrator.pending is pending and pending.state is RequestState.REQUESTED


def test_the_machine_refuses_a_transition_it_does_not_know():
    request = SwitchRequest(ParallelConfig.parse("tp=4"), (), 0.0)
    with pytest.raises(RuntimeError, match="cannot go from requested to reported"):
        request.to(RequestState.REPORTED)
    request.to(RequestState.RUN)
    request.to(RequestState.REPORTED)
    for state in RequestState:
        with pytest.raises(RuntimeError, match="cannot go from reported"):
            request.to(state)
