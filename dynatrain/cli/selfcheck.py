"""`dynatrain selfcheck`: train on CPU with a sequence of layout switches and check each one.

Every switch is compared bitwise with an independent oracle (the pre-switch state saved with DCP and loaded
into the target layout); the oracle then trains the next step on the same micro-batches and its weights and
moments must again equal the switched run's ("next step"). The losses are compared with the same steps trained
without switches, on the first layout.

A layout's dp_replicate*dp_shard*cp*tp is the number of processes it runs on. When the sequence changes it (e.g.
"dp_shard=4 > dp_shard=2 > dp_shard=3 > dp_shard=2,tp=2"), the run is an elastic job: a store process, the
first world's ranks, and every process a scale-out will need, started up front as joiners that wait for
admission. Processes that a scale-in drops leave and exit.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

from dynatrain.cli.process_flags import add_process_flags
from dynatrain.cli.quiet import without_library_lines
from dynatrain.launch.local import PRELOAD, LaunchError, joiners_needed, launch_elastic, launch_local
from dynatrain.models.configs import MODEL_CONFIGS
from dynatrain.models.moe_configs import MOE_CONFIGS
from dynatrain.models.specs import get_zoo_config
from dynatrain.selfcheck.results import merge_losses, merge_samples, merge_switches
from dynatrain.vps.parallel_config import ParallelConfig

LOSS_RTOL = 1e-5


def add_parser(sub) -> None:
    p = sub.add_parser("selfcheck", help="train with layout switches on CPU and verify each against a DCP oracle",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="debug",
                   help=f"a zoo model: dense ({', '.join(MODEL_CONFIGS)}) or mixture of experts "
                        f"({', '.join(MOE_CONFIGS)}), whose layouts may set ep")
    p.add_argument("--module", default=None, metavar="PKG.MODULE:CLASS",
                   help="check your own LightningModule (built with no arguments; importable from the working "
                        "directory or PYTHONPATH) instead of the zoo's CausalLM --model")
    p.add_argument("--datamodule", default=None, metavar="PKG.MODULE:CLASS",
                   help="its data (default: the embedded corpus as (tokens, labels) batches of bytes)")
    p.add_argument("--devices", type=int, default=None,
                   help="processes the run starts with (default: the first layout's dp_replicate*dp_shard*tp)")
    p.add_argument("--switches", default="dp_shard=4 > dp_shard=2,tp=2 > tp=4 > dp_replicate=2,dp_shard=2 > dp_shard=4",
                   help="layouts separated by '>'; the first is the starting layout. A layout whose product "
                        "differs from the one before changes the world: processes leave, or new ones join")
    p.add_argument("--steps-between", type=int, default=2)
    p.add_argument("--budget-mb", type=float, default=64.0)
    p.add_argument("--rank-map", default="auto", choices=("auto", "optimal", "identity"),
                   help="the strategy's rank_map: how a switch arranges the processes on the new mesh")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=None, help="override the model's depth (faster checks)")
    p.add_argument("--pipeline-schedule", default="1F1B", choices=("GPipe", "1F1B", "Interleaved1F1B"),
                   help="the schedule of layouts with pp")
    p.add_argument("--stages-per-rank", type=int, default=1, help="pipeline stages per pp rank (Interleaved1F1B: 2+)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_process_flags(p)  # --verbose, --heap, --no-gc-freeze: for the ranks it starts
    p.add_argument("--chaos", type=int, default=None, metavar="SEED",
                   help="instead of --switches, a random sequence of layouts drawn from SEED over every term the "
                        "model supports, world changes up and down included (printed, so a failure is replayable)")
    p.add_argument("--steps", type=int, default=None,
                   help="with --chaos: optimizer steps of the run, one switch every --steps-between (default: 8 "
                        "switches)")
    p.add_argument("--chaos-terms", default=None, metavar="TERMS",
                   help="with --chaos: the layout terms to draw from, e.g. dp_replicate,dp_shard,tp (default: "
                        "dp_replicate, dp_shard, tp, and pp for a dense zoo model or ep for a mixture of experts)")
    p.add_argument("--max-devices", type=int, default=4, help="with --chaos: the most processes a layout runs on")
    p.add_argument("--inject", default=None, nargs="?", const="death", metavar="SCENARIOS",
                   help="instead of switches, kill a process for real and check the job's recovery: "
                        "rank-dies, joiner-dies, leaver-dies, or several separated by ','; with --chaos (no value), "
                        "one of the drawn transitions is a process killed mid-step")
    p.set_defaults(run=run)


def global_batch_for(layouts: list[ParallelConfig], micro_batch: int) -> int:
    """The smallest global batch every layout can keep: lcm of the data-parallel sizes x micro-batch."""
    return math.lcm(*(p.dp_size for p in layouts)) * micro_batch


def parse_layouts(args, model) -> tuple[list[ParallelConfig], int]:
    """The layouts of ``--switches`` and the initial world: ``--devices``, or the first layout's product."""
    try:
        layouts = [ParallelConfig.parse(s) for s in args.switches.split(">")]
    except ValueError as e:
        raise SystemExit(f"--switches: {e}") from None
    if len(layouts) < 2:
        raise SystemExit("--switches needs at least two layouts, e.g. 'dp_shard=4 > dp_shard=2,tp=2'")
    devices = args.devices or layouts[0].world_size
    elastic = any(p.world_size != layouts[0].world_size for p in layouts)
    for i, p in enumerate(layouts):
        # With a world change, each layout's product is the world it runs on; the first starts on --devices.
        world = p.world_size if elastic and i else devices
        try:
            p.validate(model, world)
            p.sequence_chunk(args.seq_len)
        except ValueError as e:
            raise SystemExit(f"--switches: {e}") from None
    return layouts, devices


def _chaos(args, model):
    """The layouts of a chaos run (and the transition that is a death, with --inject)."""
    from dynatrain.models.registry import spec_for
    from dynatrain.selfcheck.chaos import draw

    if args.chaos_terms:
        terms = tuple(t.strip() for t in args.chaos_terms.split(","))
    elif model is None:
        terms = ("dp_replicate", "dp_shard", "tp")  # a module of your own: pp and ep need more of it
    else:
        terms = ("dp_replicate", "dp_shard", "tp", "ep" if spec_for(model).routed_experts else "pp")
    switches = 8 if args.steps is None else args.steps // args.steps_between - 1
    try:
        return draw(args.chaos, switches, model, max_devices=args.max_devices, terms=terms,
                    deaths=1 if args.inject else 0)
    except ValueError as e:
        raise SystemExit(f"--chaos: {e}") from None


def zoo_config(name: str):
    """The zoo's config of that name, dense or mixture of experts (pure: the command starts without torch)."""
    try:
        return get_zoo_config(name)
    except ValueError as e:
        raise SystemExit(f"--model: {e}") from None


def run(args) -> int:
    if args.inject and args.chaos is None:
        from dynatrain.selfcheck.faults import run_scenarios

        return run_scenarios(args)
    model = None if args.module else zoo_config(args.model)
    chaos = None
    if args.chaos is not None:
        chaos = _chaos(args, model)
        args.switches = chaos.switches
        death = "" if chaos.death is None else f", process death at transition {chaos.death}"
        print(f"selfcheck --chaos {args.chaos}{' --inject' if args.inject else ''}: --switches "
              f"\"{chaos.switches}\"{death}", file=sys.stderr, flush=True)
    layouts, devices = parse_layouts(args, model)
    if args.steps_between < 1:
        raise SystemExit("--steps-between must be at least 1")
    worlds = [p.world_size for p in layouts]
    joiners = joiners_needed(worlds)
    batch = global_batch_for(layouts, args.micro_batch)
    with tempfile.TemporaryDirectory(prefix="dynatrain-selfcheck-") as tmp:
        common = ["-m", "dynatrain.selfcheck.worker", "--model", args.model,
                  "--layouts", " > ".join(str(p) for p in layouts), "--steps-between", str(args.steps_between),
                  "--global-batch", str(batch), "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len),
                  "--budget-mb", str(args.budget_mb), "--rank-map", args.rank_map, "--workdir", tmp]
        if args.n_layers:
            common += ["--n-layers", str(args.n_layers)]
        if any(p.pp > 1 for p in layouts):
            common += ["--pipeline-schedule", args.pipeline_schedule, "--stages-per-rank", str(args.stages_per_rank)]
        for flag in ("module", "datamodule"):
            if getattr(args, flag):
                common += [f"--{flag}", getattr(args, flag)]
        death = chaos.death if chaos is not None else None
        try:
            switching = _run_switching([*common, *(["--death", str(death)] if death is not None else [])], devices,
                                       worlds, joiners, Path(tmp), args.timeout, death is not None)
            # The switching run's zygote forks this one too (one import for both).
            static = launch_local([*common, "--static"], devices, Path(tmp), timeout=args.timeout, name="static",
                                  preload=PRELOAD, keep_zygote=True)
        except LaunchError as e:
            print(f"selfcheck failed to run:\n{without_library_lines(str(e))}", file=sys.stderr)
            return 1
        victims = sorted(p.name for p in (Path(tmp) / "switching").glob("victim-*"))
    died = [r for r in switching if r is None]
    if death is not None and (len(died) != 1 or len(victims) != 1):
        print(f"selfcheck: one process was to die at transition {death}; {len(victims)} did and {len(died)} gave "
              "no result", file=sys.stderr)
        return 1
    switching = [r for r in switching if r is not None]
    a, b = merge_losses(switching), static[0]["losses"]
    diff = max((abs(x - y) / abs(y) for x, y in zip(a, b)), default=float("inf")) if len(a) == len(b) else float("inf")
    result = {
        "model": args.module or args.model, "devices": devices, "worlds": worlds, "joiners": joiners, "global_batch": batch,
        "switches": merge_switches(switching),
        "loss_max_rel_diff": diff, "losses": a, "static_losses": b,
        # The samples of each step, where the strategy splits the data (a module's own dataloader): the same
        # global batches as the run without switches.
        "samples_equal": merge_samples(switching) == static[0].get("samples", []),
        "samples": merge_samples(switching),
    }
    if chaos is not None:
        result["chaos"] = {"seed": args.chaos, "switches": chaos.switches, "death": chaos.death}
    ok = (len(result["switches"]) == len(layouts) - 1
          and all(s["bitwise_equal"] and s["step_after_equal"] is not False for s in result["switches"])
          and diff <= LOSS_RTOL and result["samples_equal"])
    result["ok"] = ok
    if args.json:
        print(json.dumps(result))
    else:
        _print_table(result, args.module or args.model)
    return 0 if ok else 1


def _run_switching(common: list[str], devices: int, worlds: list[int], joiners: int, workdir: Path,
                   timeout: float, death: bool = False) -> list[dict | None]:
    """Every process's result: the ranks of a fixed world, or an elastic job's members and joiners. With a
    ``death`` any one of them may be the one killed (its result is None)."""
    if all(w == devices for w in worlds):
        return launch_local(common, devices, workdir, timeout=timeout, name="switching", preload=PRELOAD,
                            keep_zygote=True)
    # The collectives' timeout is bounded so that a process that died surfaces as an error, not a long hang;
    # a joiner may wait for its scale-out as long as the whole run.
    argv = [*common, "--elastic", "--elastic-timeout", str(min(timeout, 300.0)), "--join-timeout", str(timeout)]
    members, joined = launch_elastic(argv, devices, workdir, joiners=joiners, timeout=timeout, name="switching",
                                     preload=PRELOAD, keep_zygote=True,
                                     may_die=range(devices) if death else (), joiners_may_die=death)
    return members + joined


def _print_table(result: dict, model: str) -> None:
    worlds = " > ".join(str(w) for w in result["worlds"])
    print(f"selfcheck: model {model} on {result['devices']} CPU processes (worlds {worlds}, "
          f"{result['joiners']} joining), global batch {result['global_batch']}")
    print(f"{'from':<28} {'to':<28} {'procs':<6} {'bitwise':<8} {'next step':<9} {'MiB moved':>9} {'seconds':>8} "
          f"{'peak MiB':>9}")
    for s in result["switches"]:
        procs = f"{s['world_from']}>{s['world_to']}"
        moved, secs, peak = (s["bytes_moved"] or 0) / 2**20, s["seconds"] or 0.0, (s["peak_bytes"] or 0) / 2**20
        print(f"{s['from']:<28} {s['to']:<28} {procs:<6} {str(s['bitwise_equal']):<8} "
              f"{str(s['step_after_equal']):<9} {moved:>9.2f} {secs:>8.3f} {peak:>9.2f}")
    if "chaos" in result:
        print(f"chaos seed {result['chaos']['seed']}: --switches \"{result['chaos']['switches']}\"")
    print(f"loss max relative difference against the run without switches: {result['loss_max_rel_diff']:.2e} "
          f"(tolerance {LOSS_RTOL})")
    print("OK" if result["ok"] else "FAILED")
