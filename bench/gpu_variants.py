"""The cuda backend's launch variants on the paper batch, measured in one run, so that one GPU loan
picks the fastest (``bench/gpu.sh``'s variants stage; 26 variants, well under 4 minutes on an H200).

A variant is a ``CudaTuning``: run-time choices of the same kernels (threads a block at most, blocks an
SM, the packed slot, the slot index, the order of the groups) or a compile-time ``KernelVariant`` of
them (loads in flight a thread, merging a warp's equal ids, the load-ahead; each compiled by NVRTC at its
first call, which the warm-up call takes), none of which may change a bit of the result. For each variant:
- exactness: its advantages ``torch.equal`` to the reference (the torch backend on the same device); a
  variant that differs is dropped from the ranking, with the number of positions that differ;
- ``call_s``: ``--repeats`` calls with ``out=``, each between CUDA events with the device idle before it
  (the host's work included, as a trainer waits for it), after a warm-up call: median and spread;
- ``replay_s``: ``--repeats`` replays of the variant's plan captured in a CUDA graph, timed the same way;
- ``kernels_us``: each kernel's device time in one call (the torch profiler);
- ``host``: a CPU profile of ``--repeats`` calls (cProfile): the functions with the most own time.
The report, ``<out>/<device>-<date>-gpu-variants.json``, is written after every variant (a cut run
keeps what it measured) and ranks the exact variants by median call time (``ranking``; ``best``).
The variants live until such a run has picked the winner: that run makes it the default and deletes
the others.

``run_variants`` is the measurement itself, for any way of calling a variant: the suite runs it on the
CPU emulator of the cuda kernels with wall-clock timings (``tests/test_gpu_script.py``).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import pstats
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from bench.data import make_batch
from bench.gpu_check import event_times, kernel_shares
from bench.grid import PAPER_SHAPE
from bench.machine import machine_info, machine_slug, today
from bench.__main__ import _shape
from ktae_kernels import (CudaTuning, ExecutionOptions, KernelVariant, KTAEConfig, plan_token_advantage,
                          token_advantage)
from ktae_kernels.backends import cuda
from ktae_kernels.validation import normalise_batch

#: the compile-time variants measured, each on the default launch choices.
KERNEL_VARIANTS = {"unroll2": KernelVariant(unroll=2), "unroll8": KernelVariant(unroll=8),
                   "lanes-alone": KernelVariant(match_any=False), "no-load-ahead": KernelVariant(load_ahead=False)}


def paper_variants() -> dict[str, CudaTuning]:
    """The default, the default taking the largest groups first, the default compiled as each of
    ``KERNEL_VARIANTS``, then each block size x blocks an SM x slot x slot index, named by the threads a
    block runs on the paper batch's L (a cap that runs as many as a smaller one is left out; two blocks an
    SM cap a block at 512 threads)."""
    variants = {"default": CudaTuning(), "largest-first": CudaTuning(largest_first=True)}
    variants.update({name: CudaTuning(variant=variant) for name, variant in KERNEL_VARIANTS.items()})
    for blocks in (1, 2):
        for cap in (256, 384, 512, 768, 1024):
            runs = cuda.block_threads(PAPER_SHAPE.L, cuda.most_threads(cap, blocks))
            for packed in (True, False):
                for index in (True, False):
                    name = f"threads{runs}-sm{blocks}-{'packed' if packed else 'wide'}-{'index' if index else 'reread'}"
                    variants.setdefault(name, CudaTuning(max_threads=cap, blocks_per_sm=blocks, packed=packed,
                                                         slot_index=index))
    return variants


#: the variants measured (``paper_variants``).
VARIANTS = paper_variants()
#: functions listed per variant in the host profile.
HOST_TOP = 12

#: ``call(tuning, out)`` runs the batch's ``token_advantage`` with that tuning into ``out``.
Call = Callable[[CudaTuning, Tensor], Tensor]
#: ``capture(tuning, out)`` captures the batch's plan in a CUDA graph writing ``out`` and returns a
#: function that replays it (None: no graphs here).
Capture = Callable[[CudaTuning, Tensor], Callable[[], None]]


def run_variants(variants: dict[str, CudaTuning], call: Call, reference: Tensor, repeats: int,
                 capture: Capture | None = None, threads: Callable[[CudaTuning], int] | None = None,
                 save: Callable[[dict], None] = lambda report: None) -> dict[str, Any]:
    """Each variant measured (see the module docstring) into ``{"variants": {name: row}, "ranking": [...],
    "best": name}``; ``save`` gets the report after every variant. ``threads(tuning)``: the threads a
    block of the variant runs (its name gives the cap)."""
    report: dict[str, Any] = {"repeats": repeats, "variants": {}, "ranking": [], "best": None}
    for name, tuning in variants.items():
        out = torch.empty_like(reference)
        row: dict[str, Any] = {"tuning": dataclasses.asdict(tuning)}
        if threads is not None:
            row["threads"] = threads(tuning)
        try:
            call(tuning, out)
            row["exact"] = torch.equal(out, reference)
            if not row["exact"]:
                row["positions_differing"] = int((out != reference).sum())
                raise AssertionError(f"{row['positions_differing']} positions differ from the reference")
            row["call_s"] = event_times(lambda: call(tuning, out), repeats)
            if capture is not None:
                row["replay_s"] = event_times(capture(tuning, out), repeats)
            if torch.cuda.is_available():
                row["kernels_us"] = kernel_shares(lambda: call(tuning, out))
            row["host"] = host_profile(lambda: call(tuning, out), repeats)
        except Exception as err:  # a failed or inexact variant is recorded and dropped; the others still run
            row.update(exact=row.get("exact", False), error=f"{type(err).__name__}: {err}")
        report["variants"][name] = row
        report["ranking"] = sorted((n for n, r in report["variants"].items() if r.get("exact") and "call_s" in r),
                                   key=lambda n: report["variants"][n]["call_s"]["median"])
        report["best"] = report["ranking"][0] if report["ranking"] else None
        save(report)
        timing = f"{1e3 * row['call_s']['median']:.3f} ms" if "call_s" in row else row.get("error", "")
        print(f"  {name:<28} {'exact' if row.get('exact') else 'DROPPED'} {timing}", flush=True)
    return report


def host_profile(fn: Callable[[], Any], repeats: int) -> list[dict[str, Any]]:
    """The ``HOST_TOP`` functions with the most own time over ``repeats`` calls of ``fn`` (cProfile):
    where, calls, own and cumulative seconds per call."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:HOST_TOP]
    return [{"function": f"{Path(file).name}:{line}({func})", "calls": calls / repeats,
             "own_s": own / repeats, "cumulative_s": cumulative / repeats}
            for (file, line, func), (_, calls, own, cumulative, _) in rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench-results"),
                   help="output folder (default ./bench-results/, git-ignored)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--shape", type=_shape, default=PAPER_SHAPE, metavar="GxPxL",
                   help="G rollouts x P prompts x L positions (default: the paper batch, 16x1024x3072; the "
                        "variants are named by the threads they run on its L)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: the variants are measured on a GPU (the suite runs run_variants on the "
              "CPU emulator)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    batch = make_batch(args.shape, device=device, seed=0).args()
    responses, mask, rewards, index = batch
    reference = token_advantage(*batch, backend="torch")

    def call(tuning: CudaTuning, out: Tensor) -> Tensor:
        return token_advantage(*batch, backend="cuda", out=out, options=ExecutionOptions(cuda=tuning))

    def capture(tuning: CudaTuning, out: Tensor) -> Callable[[], None]:
        plan = plan_token_advantage(index, tuple(responses.shape), device=device, backend="cuda",
                                    options=ExecutionOptions(cuda=tuning))
        static = (responses, mask.bool(), rewards.double())
        plan(*static, out=out)  # the warm-up: this layout's tables learnt
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            plan(*static, out=out)
        return graph.replay

    def threads(tuning: CudaTuning) -> int:
        return cuda.static_plan(launcher, normalised, KTAEConfig(), tuning).threads

    launcher, normalised = cuda.load_launcher(device), normalise_batch(*batch)
    report: dict[str, Any] = {"machine": machine_info(device), "date": today(), "shape": str(args.shape)}
    stem = args.out / f"{machine_slug(device)}-{today()}-gpu-variants"
    args.out.mkdir(parents=True, exist_ok=True)

    def save(measured: dict) -> None:
        report.update(measured)
        partial = stem.with_suffix(".json.part")
        partial.write_text(json.dumps(report, indent=2, default=str))
        os.replace(partial, stem.with_suffix(".json"))

    measured = run_variants(VARIANTS, call, reference, args.repeats, capture, threads, save=save)
    print(f"wrote {stem}.json; best: {measured['best']} of {len(measured['ranking'])} exact variants", flush=True)
    return 0 if measured["best"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
