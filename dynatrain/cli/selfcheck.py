"""`dynatrain selfcheck`: train on CPU with a sequence of layout switches and check each one.

Every switch is compared bitwise with an independent oracle (the pre-switch state saved with DCP and loaded
into the target layout); the oracle then trains the next step on the same micro-batches and its weights and
moments must again equal the switched run's ("next step"). The losses are compared with the same steps trained
without switches.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

from dynatrain.launcher import LaunchError, launch_local
from dynatrain.models.configs import get_model_config
from dynatrain.vps.parallel_config import ParallelConfig

LOSS_RTOL = 1e-5


def add_parser(sub) -> None:
    p = sub.add_parser("selfcheck", help="train with layout switches on CPU and verify each against a DCP oracle",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="debug")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--switches", default="dp_shard=4 > dp_shard=2,tp=2 > tp=4 > dp_replicate=2,dp_shard=2 > dp_shard=4",
                   help="layouts separated by '>'; the first is the starting layout")
    p.add_argument("--steps-between", type=int, default=2)
    p.add_argument("--budget-mb", type=float, default=64.0)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=None, help="override the model's depth (faster checks)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run)


def global_batch_for(layouts: list[ParallelConfig], micro_batch: int) -> int:
    """The smallest global batch every layout can keep: lcm of the data-parallel sizes x micro-batch."""
    return math.lcm(*(p.dp_size for p in layouts)) * micro_batch


def run(args) -> int:
    model = get_model_config(args.model)
    layouts = [ParallelConfig.parse(s) for s in args.switches.split(">")]
    if len(layouts) < 2:
        raise SystemExit("--switches needs at least two layouts, e.g. 'dp_shard=4 > dp_shard=2,tp=2'")
    for p in layouts:
        try:
            p.validate(model, args.devices)
        except ValueError as e:
            raise SystemExit(f"--switches: {e}") from None
    if args.steps_between < 1:
        raise SystemExit("--steps-between must be at least 1")
    batch = global_batch_for(layouts, args.micro_batch)
    with tempfile.TemporaryDirectory(prefix="dynatrain-selfcheck-") as tmp:
        common = ["-m", "dynatrain.selfcheck.worker", "--model", args.model,
                  "--layouts", " > ".join(str(p) for p in layouts), "--steps-between", str(args.steps_between),
                  "--global-batch", str(batch), "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len),
                  "--budget-mb", str(args.budget_mb), "--workdir", tmp]
        if args.n_layers:
            common += ["--n-layers", str(args.n_layers)]
        try:
            switching = launch_local(common, args.devices, Path(tmp), timeout=args.timeout, name="switching")
            static = launch_local([*common, "--static"], args.devices, Path(tmp), timeout=args.timeout, name="static")
        except LaunchError as e:
            print(f"selfcheck failed to run:\n{e}", file=sys.stderr)
            return 1
    a, b = switching[0]["losses"], static[0]["losses"]
    diff = max((abs(x - y) / abs(y) for x, y in zip(a, b)), default=float("inf")) if len(a) == len(b) else float("inf")
    result = {
        "model": args.model, "devices": args.devices, "global_batch": batch,
        "switches": [{k: s[k] for k in ("from", "to", "bitwise_equal", "step_after_equal", "bytes_moved", "seconds",
                                        "peak_bytes")}
                     for s in switching[0]["switches"]],
        "loss_max_rel_diff": diff, "losses": a, "static_losses": b,
    }
    ok = (len(result["switches"]) == len(layouts) - 1
          and all(s["bitwise_equal"] and s["step_after_equal"] is not False for s in result["switches"])
          and diff <= LOSS_RTOL)
    result["ok"] = ok
    if args.json:
        print(json.dumps(result))
    else:
        print(f"selfcheck: model {args.model} on {args.devices} CPU processes, global batch {batch}")
        print(f"{'from':<28} {'to':<28} {'bitwise':<8} {'next step':<9} {'MiB moved':>9} {'seconds':>8} "
              f"{'peak MiB':>9}")
        for s in result["switches"]:
            print(f"{s['from']:<28} {s['to']:<28} {str(s['bitwise_equal']):<8} {str(s['step_after_equal']):<9} "
                  f"{s['bytes_moved'] / 2**20:>9.2f} {s['seconds']:>8.3f} {s['peak_bytes'] / 2**20:>9.2f}")
        print(f"loss max relative difference against the run without switches: {diff:.2e} (tolerance {LOSS_RTOL})")
        print("OK" if ok else "FAILED")
    return 0 if ok else 1
