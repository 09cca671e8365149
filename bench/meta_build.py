"""What building a switch's target on the meta device costs, per model and layout: one process, one core.

    python bench/meta_build.py --json bench/results/meta_build.json

A switch needs the module parallelised for its target: the placements every state gets there, and the module it
trains on afterwards. dynatrain builds it on the meta device from a copy of the module (`target.meta_copy`), with the
module's own parallelisation (here the dense kind's `parallelize_dense`) on a mesh of the target's shape. Every request
builds it at once, on the training thread, to refuse a target the module cannot be parallelised for (a world change
on a probe mesh of the target's shape); a switch within the world reuses that build, a world change builds again on
the next world's mesh inside its stall. Per model and layout, median of ``--repeats``: the copy, the parallelisation
on a probe mesh (fake groups of the layout's shape: no process group is created), and reading every parameter's and
buffer's placements from the result (`capture.merged_shardings`). CPU seconds beside wall seconds: other jobs share
the cores.
``--profile MODEL:LAYOUT`` profiles one more parallelisation of that pair and keeps the functions that took most of
it, cumulative, in the JSON:

    python bench/meta_build.py --repeats 3 --profile "llama3-70b:dp_shard=8,tp=8" --json bench/results/meta_build.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dynatrain.models.configs import get_model_config  # noqa: E402
from dynatrain.models.llama import Transformer  # noqa: E402
from dynatrain.models.parallelize_dense import parallelize_dense  # noqa: E402
from dynatrain.switch.capture import merged_shardings  # noqa: E402
from dynatrain.switch.probe import probe_mesh  # noqa: E402
from dynatrain.switch.target import meta_copy  # noqa: E402
from dynatrain.vps.parallel_config import ParallelConfig  # noqa: E402

MODELS = "debug,125m,llama3-8b,llama3-70b,llama3-405b"
LAYOUTS = "dp_shard=64;dp_shard=8,tp=8;dp_shard=16,tp=4"
PARTS = ("copy", "parallelize", "placements")


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def build_once(model: torch.nn.Module, pcfg: ParallelConfig) -> dict:
    row = {}
    copy, row["copy_s"], row["copy_cpu_s"] = timed(lambda: meta_copy(model))
    with probe_mesh(pcfg, "cpu") as mesh:
        _, row["parallelize_s"], row["parallelize_cpu_s"] = timed(lambda: parallelize_dense(copy, mesh, pcfg))
        table, row["placements_s"], row["placements_cpu_s"] = timed(lambda: merged_shardings([(copy, mesh)]))
    row["parameters_and_buffers"] = len(table)
    row["total_s"] = sum(row[f"{p}_s"] for p in PARTS)
    row["total_cpu_s"] = sum(row[f"{p}_cpu_s"] for p in PARTS)
    return row


def profile_once(model: torch.nn.Module, pcfg: ParallelConfig, top: int = 25) -> list[dict]:
    """The functions with the most cumulative time in one parallelisation (under the profiler, which slows it)."""
    copy = meta_copy(model)
    with probe_mesh(pcfg, "cpu") as mesh:
        prof = cProfile.Profile()
        prof.runcall(parallelize_dense, copy, mesh, pcfg)
    stats = pstats.Stats(prof).stats
    rows = [{"function": f"{Path(f).name}:{line}({name})", "calls": nc, "cumulative_s": ct}
            for (f, line, name), (_, nc, _, ct, _) in stats.items()]
    return sorted(rows, key=lambda r: -r["cumulative_s"])[:top]


def median_row(rows: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_s")}
    out["total_s_range"] = [min(r["total_s"] for r in rows), max(r["total_s"] for r in rows)]
    out["parameters_and_buffers"] = rows[0]["parameters_and_buffers"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--layouts", default=LAYOUTS, help="';'-separated layouts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", default=None, metavar="MODEL:LAYOUT")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            results = []
            for name in args.models.split(","):
                cfg = get_model_config(name)
                with torch.device("meta"):
                    model = Transformer(cfg)
                for layout in args.layouts.split(";"):
                    pcfg = ParallelConfig.parse(layout)
                    try:
                        pcfg.validate(cfg, None)
                    except ValueError as e:  # the layout does not fit this model's shape
                        results.append({"model": name, "layout": pcfg.short(), "skipped": str(e)})
                        print(f"{name:12s} {pcfg.short():18s} skipped: {e}", flush=True)
                        continue
                    row = {"model": name, "layout": pcfg.short(), "load_average": os.getloadavg()[0],
                           **median_row([build_once(model, pcfg) for _ in range(args.repeats)])}
                    results.append(row)
                    print(f"{name:12s} {pcfg.short():18s} copy {row['copy_s']:.3f}  parallelize "
                          f"{row['parallelize_s']:.3f}  placements {row['placements_s']:.3f}  total "
                          f"{row['total_s']:.3f} s (cpu {row['total_cpu_s']:.3f})", flush=True)
            profile = None
            if args.profile:
                name, layout = args.profile.split(":", 1)
                cfg = get_model_config(name)
                with torch.device("meta"):
                    model = Transformer(cfg)
                profile = {"model": name, "layout": layout,
                           "top": profile_once(model, ParallelConfig.parse(layout).validate(cfg))}
                for r in profile["top"]:
                    print(f"  {r['cumulative_s']:7.3f} s  {r['calls']:6d}  {r['function']}", flush=True)
        finally:
            dist.destroy_process_group()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "args": vars(args),
                                               "torch": torch.__version__, "results": results, "profile": profile},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
