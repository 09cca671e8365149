"""Part (f): the mixture-of-experts debug model on the device, fp32 and bf16: its loss and every gradient against the
same model in float64 on the CPU (experts computed by the per-expert loop there), no further from it than the CPU
in the same dtype (twice its error, plus a tolerance).
On a GPU this runs `torch._grouped_mm`'s CUDA kernels and the routing's device code, which no CPU run reaches.

    python bench/gpu_check/moe_devices.py --device cuda --out /tmp/f.json
"""

from __future__ import annotations

import common
import torch

# The device may err from float64 by at most twice what the CPU does in the same dtype, plus this (relative, of the
# loss and of each gradient in norm): routing in bf16 flips a few top-k choices on any device.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def forward_backward(model, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().to("cpu", torch.float64) for n, p in model.named_parameters()
                         if p.grad is not None}


def run(args, device: torch.device) -> dict:
    from dynatrain.models.moe import MoETransformer
    from dynatrain.models.moe_configs import MOE_CONFIGS

    torch.manual_seed(0)
    cfg = MOE_CONFIGS["moe-debug"]
    reference = MoETransformer(cfg)
    reference.init_weights()
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    exact = reference.to(torch.float64)
    for m in exact.modules():
        if hasattr(m, "use_grouped_mm"):
            m.use_grouped_mm = False  # the per-expert loop: the one way float64 runs
    want_loss, want = forward_backward(exact, tokens)
    rows, checks = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        errors = {}
        for where in dict.fromkeys([device, torch.device("cpu")]):  # the device, and the CPU for comparison
            model = MoETransformer(cfg)
            model.load_state_dict(exact.state_dict())
            loss, grads = forward_backward(model.to(device=where, dtype=dtype), tokens.to(where))
            errors[where.type] = {"loss": loss, "loss_error": abs(loss - want_loss) / max(abs(want_loss), 1e-30),
                                  "worst_grad_error": max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-30))
                                                          for n, g in want.items()),
                                  "gradients": sorted(grads) == sorted(want)}
        dev, cpu = errors[device.type], errors["cpu"]
        rows.append({"dtype": name, "reference_loss": want_loss, **{k: v for k, v in errors.items()}})
        checks[f"{name}_as_close_as_the_cpu"] = dev["gradients"] and all(
            dev[k] <= 2 * cpu[k] + TOLERANCE[dtype] for k in ("loss_error", "worst_grad_error"))
    return {"model": "moe-debug", "runs": rows, "checks": checks}


if __name__ == "__main__":
    common.run_part("moe_devices", __doc__, run)
