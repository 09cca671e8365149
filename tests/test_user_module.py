"""A user's own LightningModule (tests/workers/user_model.py, nothing written for dynatrain) switches online."""

from __future__ import annotations

import types

import pytest
import torch
from _launch import launch, selfcheck_module

from dynatrain.switch.capture import BUFFER, capture, check_switchable

SEQUENCE = ["dp_shard=2,tp=2", "dp_replicate=2,dp_shard=2", "tp=4", "dp_shard=4"]


def _switches(layouts: list[str]) -> str:
    return ";".join(f"{i + 1}:{layout}" for i, layout in enumerate(layouts))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
# Adam's states (with amsgrad's third) and SGD's momentum, the module built in __init__ and in configure_model();
# plain AdamW adds nothing a switch treats differently (its states are amsgrad's less one).
@pytest.mark.parametrize("optimizer,build_in", [("sgd", "configure"), ("amsgrad", "init")])
def test_a_user_module_switches_through_every_layout_and_trains_as_without_switches(tmp_path, optimizer, build_in):
    common = ["--layout", "dp_shard=4", "--steps", "5", "--optimizer", optimizer, "--build-in", build_in]
    static = launch("user_switch.py", 4, common, tmp_path / "static")
    switched = launch("user_switch.py", 4, [*common, "--switches", _switches(SEQUENCE)], tmp_path / "switched")
    for res, ref in zip(switched, static):
        pairs = [(r["old_layout"], r["new_layout"]) for r in res["reports"]]
        assert pairs == list(zip(["dp_shard=4", *SEQUENCE[:-1]], SEQUENCE))
        assert all(r["verified"] is True for r in res["reports"])  # every state bitwise where it was
        assert any(r["bytes_moved"] > 0 for r in res["reports"])
        assert len(res["losses"]) == len(ref["losses"]) == 5
        for a, b in zip(res["losses"], ref["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (res["losses"], ref["losses"])
        # the buffer the loop changes, the LR schedule and the optimizer's kinds of state carried over
        assert res["logit_scale"] == ref["logit_scale"] and res["lr"] == ref["lr"]
        assert res["state_keys"] == ref["state_keys"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("args,expected", [
    (["--optimizer", "rowscaled"], ["RowScaled keeps a tensor of shape"]),  # a factored optimizer state
    (["--heads", "1"], ["parallelisation failed for tp=2", "does not divide the 1 attention heads"]),
], ids=["factored-optimizer", "parallelisation-fails"])
def test_what_a_switch_cannot_carry_is_refused_at_request_time_and_training_goes_on(tmp_path, args, expected):
    results = launch("user_switch.py", 2, ["--layout", "dp_shard=2", "--steps", "3", *args, "--bad", "1:tp=2"],
                     tmp_path)
    for res in results:
        assert res["reports"] == [] and res["layout"] == "dp_shard=2" and len(res["losses"]) == 3
        [error] = res["errors"]
        assert all(text in error for text in expected), error
        assert res["untouched"] == [True]  # every weight, buffer and optimizer tensor bitwise as before


_ROOT = types.SimpleNamespace(mesh=torch.arange(1).view(1, 1, 1))


@pytest.mark.parametrize("name,routed", [
    ("adamw", {"exp_avg", "exp_avg_sq"}), ("sgd", {"momentum_buffer"}),
    ("amsgrad", {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}), ("rmsprop", {"square_avg", "momentum_buffer"}),
    ("adagrad", {"sum"}),
])
def test_optimizer_tensors_of_the_parameters_shape_are_routed_and_scalars_kept(name, routed):
    from workers.user_model import OPTIMIZERS, TinyLM

    model = TinyLM(layers=1)
    opt = OPTIMIZERS[name](model.parameters())
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    opt.step()
    check_switchable(model, [opt])
    cap = capture(model, opt, _ROOT)
    keys = {key for _, key in cap.param_of.values() if key not in (None, BUFFER)}
    assert keys == routed
    assert all(set(v) <= {"step"} for v in cap.scalars.values())
    # buffers travel whole, a 0-d one as one element
    assert {n for n, (_, key) in cap.param_of.items() if key == BUFFER} == {"logit_scale", "positions_seen"}


def test_a_tied_weight_is_one_state_and_a_factored_optimizer_and_two_optimizers_are_refused():
    from workers.user_model import OPTIMIZERS, TinyLM

    model = TinyLM(layers=1)
    model.head.weight = model.embed.weight
    check_switchable(model, [])
    cap = capture(model, None, _ROOT)
    assert "embed.weight" in cap.param_of and "head.weight" not in cap.param_of  # captured and moved once
    model = TinyLM(layers=1)
    opt = OPTIMIZERS["adafactor"](model.parameters())
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="Adafactor keeps a tensor of shape"):
        check_switchable(model, [opt])
    with pytest.raises(ValueError, match="returned 2 optimizers"):
        check_switchable(TinyLM(layers=1), [opt, opt])


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_selfcheck_module_checks_a_users_own_module_through_a_scale_in_and_out_against_the_dcp_oracle():
    """4 -> 3 -> 4 processes: one leaves with its shards sent, then a new process joins and builds its module by its
    own configure_model(); every switch equals the DCP oracle bit for bit, and so does the step after it (checked
    by the helper). The fixed-world layouts of this module are held by the test above."""
    layouts = ["dp_shard=4", "dp_shard=3", "dp_shard=2,tp=2"]
    result = selfcheck_module("user_model:UserLM", layouts)
    assert result["worlds"] == [4, 3, 4] and result["joiners"] == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_selfcheck_module_checks_a_users_moe_module_through_world_changes_against_the_dcp_oracle():
    """The zoo's mixture of experts in a user's module (its own configure_model()): ep=4 on 4 processes, a scale-in
    to 3 without ep, a scale-out to 4 with tp and ep; the router's buffers move with it."""
    result = selfcheck_module("user_model:MoELM", ["dp_shard=4,ep=4", "dp_shard=3", "dp_shard=2,tp=2,ep=2"])
    assert result["worlds"] == [4, 3, 4] and result["loss_max_rel_diff"] <= 1e-5


def test_fully_shard_on_the_module_a_dtensor_buffer_an_unmovable_dtype_and_foreign_tensors_are_refused(
        one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    from workers.user_model import TinyLM

    mesh = init_device_mesh("cpu", (1,))
    whole = TinyLM(layers=1)
    fully_shard(whole, mesh=mesh)
    with pytest.raises(ValueError, match="fully_shard was applied to the LightningModule itself"):
        check_switchable(whole, [])
    with_dtensor = TinyLM(layers=1)
    with_dtensor.register_buffer("scale", distribute_tensor(torch.ones(4), mesh, [Replicate()]))
    with pytest.raises(ValueError, match="buffer 'scale' is a DTensor"):
        check_switchable(with_dtensor, [])
    complex_buffer = TinyLM(layers=1)
    complex_buffer.register_buffer("phase", torch.ones(4, dtype=torch.complex128))
    with pytest.raises(ValueError, match="buffer 'phase' has dtype torch.complex128, which a switch cannot move"):
        check_switchable(complex_buffer, [])
    model = TinyLM(layers=1)
    foreign = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*model.parameters(), foreign], lr=0.1)
    with pytest.raises(ValueError, match="optimizes 1 tensor\\(s\\) that are not parameters of the LightningModule"):
        check_switchable(model, [opt])
    check_switchable(model, [torch.optim.SGD(model.parameters(), lr=0.1)])  # the same without the foreign tensor


def test_the_oracle_compares_non_persistent_buffers_with_what_was_saved_not_with_themselves(tmp_path):
    from dynatrain.selfcheck import oracle
    from workers.user_model import TinyLM

    live = TinyLM(layers=1)
    live.positions_seen += 5  # non-persistent: DCP does not hold it
    opt = torch.optim.SGD(live.parameters(), lr=0.1)
    oracle.save(live, opt, tmp_path / "ckpt")
    fresh = TinyLM(layers=1)
    fresh.load_state_dict(live.state_dict())
    oracle.restore_buffers(fresh, tmp_path / "ckpt")
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    assert oracle.bitwise_equal(live, opt, fresh, fresh_opt, torch.device("cpu"))
    live.positions_seen += 1  # a switch that carried the buffer wrong
    assert not oracle.bitwise_equal(live, opt, fresh, fresh_opt, torch.device("cpu"))
