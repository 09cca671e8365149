"""What every part of the GPU check shares: the device it runs on, its size (full on CUDA, tiny on the CPU fallback),
and its one JSON, written whatever happens so that one broken part leaves the others' results."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the repository, where `pip install -e .` could not run
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="cuda, cpu, or auto: cuda where one is visible")
    ap.add_argument("--out", required=True, help="the part's JSON file")
    return ap


def device_of(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible here")
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "pid": os.getpid()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpus"] = torch.cuda.device_count()
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def run_part(name: str, doc: str, body: Callable[[argparse.Namespace, torch.device], dict],
             add_args: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """Parse the arguments, run ``body`` and write its figures with a status: ``ok`` when every entry of its
    ``checks`` holds, ``failed`` when one does not, ``error`` with the traceback when it raised, ``skipped`` when it
    says so itself. Exits 0 unless it failed or raised."""
    ap = parser(doc)
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args()
    started = time.perf_counter()
    result: dict = {"part": name, **host()}
    try:
        device = device_of(args.device)
        result["device"] = str(device)
        figures = body(args, device)
        result.update(figures)
        if "status" not in figures:
            result["status"] = "ok" if all(figures.get("checks", {}).values()) else "failed"
    except BaseException as exc:  # noqa: BLE001 - written into the part's JSON, then the status says it
        result.update(status="error", error=f"{type(exc).__name__}: {exc}"[:4000], traceback=traceback.format_exc())
        traceback.print_exc()
    result["seconds"] = time.perf_counter() - started
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: result.get(k) for k in ("part", "status", "device", "checks", "error")}, default=str))
    sys.exit(0 if result["status"] in ("ok", "skipped") else 1)
