"""The paper batch against its targets: time vs the device's target, bandwidth vs the I/O floor,
share of a DAPO step.

The paper batch is G = 16 rollouts x 1024 prompts, L = 3072 (B = 16384). Its unavoidable I/O is one
read of the int64 responses and the bool mask and one write of the float32 advantages:
13 bytes per position, 0.654 GB.
"""
from __future__ import annotations

import statistics
import time

import torch

from bench.grid import PAPER_SHAPE
from bench.report import format_number, format_ratio, format_time
from bench.runner import Result

#: end-to-end target for the paper batch per device type: 2 CPU threads (the verl driver), one H200.
TARGET_S = {"cpu": 0.1, "cuda": 5e-4}
#: wall time of one DAPO training step in the paper's setting (the project's brief).
DAPO_STEP_S = 363.0
#: bytes per position that any implementation must move: int64 id + bool mask in, float32 out.
BYTES_PER_POSITION = 8 + 1 + 4


def io_bytes(positions: int) -> int:
    """The unavoidable I/O of a ``[B, L]`` batch of ``positions = B * L``."""
    return positions * BYTES_PER_POSITION


def paper_summary(results: list[Result], copy_gb_s: float | None, device: str = "cuda") -> dict:
    """Per contender measured on the paper batch: seconds, ratio to the device's target, achieved
    bandwidth (GB/s of unavoidable I/O, and its share of the measured copy bandwidth), share of a
    DAPO step."""
    rows = {}
    for r in results:
        if r.shape != PAPER_SHAPE or r.seconds is None:
            continue
        bandwidth = io_bytes(PAPER_SHAPE.positions) / r.seconds / 1e9
        rows[r.backend] = {
            "seconds": r.seconds,
            "extrapolated": r.extrapolated,
            "x_target": r.seconds / TARGET_S[device],
            "meets_target": r.seconds <= TARGET_S[device],
            "io_gb": io_bytes(PAPER_SHAPE.positions) / 1e9,
            "achieved_gb_s": bandwidth,
            "share_of_copy_bandwidth": bandwidth / copy_gb_s if copy_gb_s else None,
            "share_of_dapo_step": r.seconds / DAPO_STEP_S,
        }
    return {"shape": {"G": PAPER_SHAPE.G, "prompts": PAPER_SHAPE.prompts, "L": PAPER_SHAPE.L},
            "target_s": TARGET_S[device], "dapo_step_s": DAPO_STEP_S, "copy_gb_s": copy_gb_s, "backends": rows}


def format_paper_summary(summary: dict) -> str:
    """Human-readable lines of ``paper_summary`` (numbers in ``format_number``'s one format)."""
    s = summary["shape"]
    shape = f"{s['G']} x {s['prompts']} x {s['L']}"
    io_gb = io_bytes(PAPER_SHAPE.positions) / 1e9
    lines = [f"Paper batch {shape} (G x P x L): I/O floor {format_number(io_gb)} GB, target "
             f"{format_time(summary['target_s'])}, DAPO step {format_number(summary['dapo_step_s'])} s"]
    if not summary["backends"]:
        lines.append(f"  not timed in this run: add --shape {shape.replace(' ', '')}, or run the default grid")
    elif summary["copy_gb_s"]:
        lines.append(f"  device copy bandwidth, measured in this run: {format_number(summary['copy_gb_s'])} GB/s "
                     "(read + write)")
    for name, row in summary["backends"].items():
        time = ("~" if row["extrapolated"] else "") + format_time(row["seconds"])
        target = "meets the target" if row["meets_target"] else f"{format_ratio(row['x_target'])} the target"
        share = row["share_of_copy_bandwidth"]
        copy = f" ({format_number(100 * share)}% of copy)" if share else ""
        lines.append(f"  {name:<15} {time:>10}  {target}; {format_number(row['achieved_gb_s'])} GB/s{copy}; "
                     f"{format_number(100 * row['share_of_dapo_step'])}% of a DAPO step")
    return "\n".join(lines)


def copy_bandwidth_gb_s(device: torch.device, gbytes: float = 4.0, repeats: int = 10) -> float:
    """Median bandwidth of a device-to-device (or host memory) copy of ``gbytes`` GB, counting the
    bytes read and written."""
    n = int(gbytes * 1e9) // 2
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * n / statistics.median(times) / 1e9
