"""``dynatrain plan``: plan a layout switch offline and print what it would cost.

    dynatrain plan --model llama3-70b --from dp_shard=16,tp=8 --to dp_shard=8,tp=8 [--leave 3,17]
    dynatrain plan --model qwen3-235b-a22b --from dp_shard=32,tp=4,ep=16 --to dp_shard=64,tp=2,ep=32
    dynatrain plan --model llama3-70b --from dp_shard=16,tp=8 --to pp=2,dp_shard=8,tp=8 [--stages-per-rank 1]
        [--rank-map identity|optimal] [--budget-mb 2048] [--gpus-per-node 8] [--link-gbps 200]
        [--nics-per-node 8] [--intra-node-gbps 3200] [--state fp32-adam|bf16-adam|fp32] [--hash-s-per-gib 0.14]
        [--json]

Besides the transfer it predicts the whole stall on its busiest rank, phase by phase (`policy.stall_model`): the
target's communicators, its build, the plan, the transfer and the check, with the formation in the stall and with
it done ahead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dynatrain.models.registry import get_zoo_config, spec_for, zoo_names
from dynatrain.models.specs import layout_for_model
from dynatrain.planner.network import NetworkModel
from dynatrain.planner.schedule import plan_switch
from dynatrain.policy.stall_model import CPU_HASH, CheckCost, predict_stall
from dynatrain.runtime.memory import freeze_import_time_objects
from dynatrain.vps.layout import STATE_KINDS
from dynatrain.vps.parallel_config import ParallelConfig

HELP = "plan a layout switch offline: bytes moved, rounds, predicted seconds"


def _process_list(text: str) -> list[int]:
    """``3,17`` or ranges ``64-127`` (inclusive), mixed freely."""
    out: list[int] = []
    for term in (t.strip() for t in text.split(",") if t.strip()):
        lo, _, hi = term.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected process ids like 3,17 or ranges like 64-127, got {text!r}") from None
        if a < 0 or b < a:
            raise argparse.ArgumentTypeError(f"bad process range {term!r} in {text!r}: use LOW-HIGH with 0 <= LOW <= HIGH")
        out += range(a, b + 1)
    return out


def _layout(text: str) -> ParallelConfig:
    try:
        return ParallelConfig.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", required=True, choices=zoo_names(),
                        help="model shapes to plan for (dense Llama or mixture-of-experts)")
    parser.add_argument("--from", dest="old", required=True, type=_layout, metavar="LAYOUT",
                        help="current layout, e.g. dp_shard=16,tp=8 or dp_shard=32,tp=4,ep=16 (processes 0..N-1 in mesh "
                             "order)")
    parser.add_argument("--to", dest="new", required=True, type=_layout, metavar="LAYOUT", help="target layout")
    parser.add_argument("--stages-per-rank", type=int, default=1, metavar="V",
                        help="pipeline stages per pp rank in both layouts (interleaved schedules take 2 or more; "
                             "default 1): with pp=P the model is split into P x V stages of whole layers")
    parser.add_argument("--leave", type=_process_list, default=[], metavar="IDS",
                        help="processes that must leave, e.g. 3,17 or 64-127 (they still send what they hold)")
    parser.add_argument("--lost", type=_process_list, default=[], metavar="IDS",
                        help="processes already gone: their shards must come from replicas")
    parser.add_argument("--rank-map", choices=("identity", "optimal"), default="optimal",
                        help="which process takes each new mesh position (default: optimal)")
    parser.add_argument("--budget-mb", type=float, default=2048.0,
                        help="staging memory per rank and round, send + receive, in MiB (default 2048)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="keep every new TP group inside one node and prefer replicas on the receiver's node "
                             "(the network model assumes 8 when this is not given)")
    parser.add_argument("--link-gbps", type=float, default=200.0, help="bandwidth of one NIC, Gbit/s (default 200)")
    parser.add_argument("--nics-per-node", type=int, default=8, help="NICs per node (default 8)")
    parser.add_argument("--intra-node-gbps", type=float, default=3200.0,
                        help="per-GPU bandwidth inside a node, Gbit/s (default 3200)")
    parser.add_argument("--state", choices=sorted(STATE_KINDS), default="fp32-adam",
                        help="fp32-adam: fp32 weight + Adam moments (12 B/element); bf16-adam: bf16 weight + fp32 "
                             "master + moments (14 B/element); fp32: weights only")
    parser.add_argument("--hash-s-per-gib", type=float, default=CPU_HASH.s_per_gib, metavar="S",
                        help=f"seconds the switch's check takes to hash a GiB on the devices (default "
                             f"{CPU_HASH.s_per_gib:g}: one CPU thread, measured; a GPU's rate is not measured)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=run)
    return parser


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``plan`` on an argparse subparsers object."""
    return configure(subparsers.add_parser("plan", help=HELP, description=HELP))


def compute(args: argparse.Namespace) -> dict:
    """The plan's figures as a dict (what --json prints)."""
    model = get_zoo_config(args.model)
    args.old.validate(model)
    args.new.validate(model)
    if not args.budget_mb > 0:
        raise ValueError(f"--budget-mb must be positive, got {args.budget_mb}")
    if args.stages_per_rank < 1:
        raise ValueError(f"--stages-per-rank must be at least 1, got {args.stages_per_rank}")
    if not args.hash_s_per_gib >= 0:
        raise ValueError(f"--hash-s-per-gib must be 0 or more, got {args.hash_s_per_gib}")
    budget = max(1, int(args.budget_mb * (1 << 20)))
    network = NetworkModel(args.gpus_per_node or 8, args.link_gbps, args.nics_per_node, args.intra_node_gbps)

    freeze_import_time_objects()  # what the planner's imports made is never garbage: keep collections cheap
    start = time.perf_counter()
    v = args.stages_per_rank
    old = layout_for_model(model, args.old, args.state, stages_per_rank=v)
    # Placements outside the rules (routed experts), and a pipeline stage holding whole layers by the model's stage
    # split: those targets' boxes come from their own analytic placements.
    target = (args.new if spec_for(model).placed_by_rules and args.new.pp == 1
              else layout_for_model(model, args.new, args.state, stages_per_rank=v))
    plan = plan_switch(old, target, leave=args.leave, lost=args.lost, rank_map=args.rank_map,
                       budget_bytes=budget, gpus_per_node=args.gpus_per_node)
    sent, recv = plan.rank_bytes()
    # What one rank computes at switch time: the global part above plus its own pieces; time the busiest.
    busiest = max(plan.processes, key=lambda p: (sent.get(p, 0) + recv.get(p, 0), -p))
    plan.rank_plan(busiest)
    plan_seconds = time.perf_counter() - start

    total = plan.bytes_total
    asg = plan.assignment
    predicted = network.predict_seconds(plan.traffic)
    hashed = max((sent.get(p, 0) + recv.get(p, 0) for p in plan.processes), default=0)
    check = (CPU_HASH if args.hash_s_per_gib == CPU_HASH.s_per_gib
             else CheckCost(args.hash_s_per_gib, device="given with --hash-s-per-gib"))
    stall = predict_stall(model, args.new, processes_old=len(old.processes), joining=len(asg.joiners),
                          transfer_s=predicted, plan_s=plan_seconds, hashed_bytes=hashed,
                          states_per_parameter=len(STATE_KINDS[args.state]), stages_per_rank=v, check=check)
    return {
        "model": model.name,
        "state": args.state,
        "from": args.old.short(),
        "to": args.new.short(),
        "stages_per_rank": v,
        "rank_map": asg.method,
        "processes_old": len(old.processes),
        "processes_new": len(plan.new.processes),
        "leaving": sorted(set(args.leave) | set(asg.idle)),
        "lost": sorted(args.lost),
        "joining": list(asg.joiners),
        "bytes_total": total,
        "bytes_moved": plan.bytes_moved,
        "bytes_moved_identity": plan.bytes_moved_identity,
        "fraction_moved": plan.bytes_moved / total if total else 0.0,
        "fraction_moved_identity": (plan.bytes_moved_identity / total
                                    if total and plan.bytes_moved_identity is not None else None),
        "max_rank_bytes": max([*sent.values(), *recv.values()], default=0),
        "max_rank_send_bytes": max(sent.values(), default=0),
        "max_rank_recv_bytes": max(recv.values(), default=0),
        "rounds": plan.num_rounds,
        "pairs": len(plan.table.pair_bytes),  # ordered (sender, receiver) pairs with bytes on the wire
        "phases": len(plan.groups),
        "budget_bytes": budget,
        "peak_staging_bytes": plan.peak_staging_bytes,
        "predicted_seconds": predicted,
        "plan_seconds": plan_seconds,
        "timed_rank": busiest,
        "network": {
            "gpus_per_node": network.gpus_per_node, "link_gbps": network.link_gbps,
            "nics_per_node": network.nics_per_node, "intra_node_gbps": network.intra_node_gbps,
            "round_latency_s": network.round_latency_s,
        },
        "stall": stall.as_dict(),
    }


def _size(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _stages(r: dict) -> str:
    pipelined = "pp=" in r["from"] or "pp=" in r["to"]
    return f", {r['stages_per_rank']} pipeline stage(s) per pp rank" if pipelined else ""


def _pct(x: float | None) -> str:
    return "" if x is None else f" ({100 * x:.1f}% of all state)"


def render(r: dict) -> str:
    net = r["network"]
    lines = [
        f"model {r['model']}, state {r['state']}",
        f"switch {r['from']} ({r['processes_old']} processes) -> {r['to']} ({r['processes_new']} processes), "
        f"rank map {r['rank_map']}{_stages(r)}; leaving {len(r['leaving'])}, lost {len(r['lost'])}, "
        f"joining {len(r['joining'])}",
        f"bytes total                {_size(r['bytes_total'])}",
        f"bytes moved                {_size(r['bytes_moved'])}{_pct(r['fraction_moved'])}",
        f"bytes moved, identity map  {_size(r['bytes_moved_identity'])}{_pct(r['fraction_moved_identity'])}",
        f"largest per-rank send      {_size(r['max_rank_send_bytes'])}",
        f"largest per-rank receive   {_size(r['max_rank_recv_bytes'])}",
        f"rounds                     {r['rounds']} in {r['phases']} phases (budget {_size(r['budget_bytes'])} per rank: "
        "half stages a round, half holds the phase in flight)",
        f"peak staging per rank      {_size(r['peak_staging_bytes'])}",
        f"predicted transfer         {r['predicted_seconds']:.3f} s ({net['gpus_per_node']} GPUs per node, "
        f"{net['nics_per_node']} x {net['link_gbps']:g} Gbit/s NICs per node, {net['intra_node_gbps']:g} Gbit/s "
        f"per GPU inside a node, {net['round_latency_s'] * 1e6:g} us per round; see docs/planner.md)",
        f"planning                   {r['plan_seconds']:.3f} s (one rank: layouts, assignment, routing, "
        f"schedule, its own pieces; timed on rank {r['timed_rank']})",
        *_stall_lines(r["stall"]),
    ]
    return "\n".join(lines)


def _stall_lines(s: dict) -> list[str]:
    """The whole stall's phase table (`policy.stall_model`; its sources in docs/benchmarks.md)."""
    worlds, mesh = s["communicators"][:s["worlds"]], s["communicators"][s["worlds"]:]
    world = (f"the union world ({worlds[0]} ranks), then the target's ({worlds[1]})" if len(worlds) == 2
             else f"the target world ({worlds[0]} ranks)")
    rows = [
        ("world", s["world"], True, f"NCCL set-up of {world}"),
        ("mesh groups", s["mesh"], True, f"NCCL set-up of {len(mesh)} communicator(s), one after another"
                                         + (f" ({', '.join(map(str, mesh))} ranks)" if mesh else "")),
        ("control group", s["control"], True, "gloo, one connection per peer"),
        ("build", s["build"], True, f"{s['wrapped']} parameters wrapped on meta, {s['split']} split by tp"),
        ("plan", s["plan"], True, "as timed above"),
        ("transfer", s["transfer"], False, "as predicted above"),
        ("check", s["check"], False, f"{_size(s['hashed_bytes'])} hashed (sent + received) at {s['check_rate']}"),
    ]
    out = ["whole stall (each phase on its busiest rank)    in stall   ahead"]
    for name, seconds, movable, what in rows:
        out.append(f"  {name:41s}{seconds:9.3f} {0.0 if movable else seconds:7.3f} s  {what}")
    out.append(f"predicted stall            {s['in_stall']:.3f} s with the formation in the stall, {s['ahead']:.3f} s "
               "with it done ahead (formation, build and plan before the boundary)")
    out.append(f"                           {s['as_built']:.3f} s as dynatrain forms ahead today (the world with "
               "its mesh's and control groups, and the plan; the build at the boundary)")
    return out


def run(args: argparse.Namespace) -> int:
    try:
        result = compute(args)
    except ValueError as err:
        print(f"dynatrain plan: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else render(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = configure(argparse.ArgumentParser(prog="dynatrain plan", description=HELP))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
