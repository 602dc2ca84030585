"""``python -m bench``: time every available backend against the scipy reference and the
upstream-style loop on a grid of realistic batches; print a table, write JSON and a PNG.

Examples::

    python -m bench                       # default grid on this machine (CUDA if present)
    python -m bench --quick               # a smoke run: 8 small batches
    python -m bench --device cuda --sweep --backends torch,triton,cuda
    python -m bench --full --repeats 10   # no caps (hours on a CPU)
    python -m bench --contend             # the cpu backend's threads, quiet and beside a busy process
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

import ktae_kernels
from bench import contention, data
from bench.contenders import ALL_NAMES, BENCH_CONFIG, REUSE_OUT, UPSTREAM, unavailable_reason
from bench.data import Shape
from bench.grid import PAPER_SHAPE, PRESETS, budget_for
from bench.machine import load_average, machine_info, machine_slug, today
from bench.paper import copy_bandwidth_gb_s, format_paper_summary, paper_summary
from bench.report import format_table, plot, result_json, shape_title, write_json
from bench.runner import EXACT_TOLERANCE, Result, run_grid

#: the default output folder, in the current directory (git-ignored); the committed results in
#: bench/results/ are only written when asked for with --out bench/results.
RESULTS_DIR = Path("bench-results")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, else cpu)")
    p.add_argument("--backends", default=None,
                   help=f"comma-separated subset of {','.join(ALL_NAMES)} (default: every one available here)")
    grid = p.add_mutually_exclusive_group()
    grid.add_argument("--preset", choices=sorted(PRESETS), default="default", help="shape grid (default: default)")
    grid.add_argument("--quick", dest="preset", action="store_const", const="quick", help="small grid (8 shapes: seconds on idle cores, minutes under load)")
    grid.add_argument("--full", dest="preset", action="store_const", const="full", help="default grid, no caps")
    grid.add_argument("--sweep", dest="preset", action="store_const", const="sweep",
                      help="G=16, B=256..65536, L=512..8192 (for GPUs)")
    p.add_argument("--shape", action="append", type=_shape, metavar="GxPxL",
                   help="run these shapes instead of a preset (repeatable), e.g. --shape 16x1024x3072")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per cell, at most (default 5)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice, usually one per core)")
    p.add_argument("--contend", type=int, nargs="?", const=0, default=None, metavar="N",
                   help="instead of the grid: the cpu backend at its default threads against one thread, on a "
                        "quiet machine and beside a process of N-thread torch matrix products (default N: one "
                        "per core), on --shape batches or 16x{8,64,256}x3072, 256x16x3072 and the paper batch")
    p.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR,
                   help=f"output folder (default ./{RESULTS_DIR}/, in the current directory)")
    p.add_argument("--tag", default="", help="extra suffix of the output file names")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a result of the same name (default: a new -run2, -run3, ... file beside it)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none either when stderr is not a terminal)")
    args = p.parse_args(argv)
    args.argv = argv
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.contend is not None:
        if args.contend < 0:
            p.error(f"--contend takes the competing process's threads, >= 1, got {args.contend}")
        if args.backends not in (None, "cpu") or args.device not in (None, "cpu"):
            p.error("--contend times the cpu backend on the CPU: drop --backends and --device")
    return args


def _shape(text: str) -> Shape:
    try:
        G, P, L = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GxPxL (e.g. 16x1024x3072), got {text!r}") from None
    if min(G, P, L) < 1:
        raise argparse.ArgumentTypeError(f"G, P and L must be >= 1, got {text!r}")
    return Shape(G, P, L)


def result_stem(stem: Path, overwrite: bool = False) -> Path:
    """Where a run writes ``.json`` (and ``.png``): ``stem``, or, when a result is already there and not
    ``overwrite``, the first free ``stem-run2``, ``stem-run3``, ... (a same-day rerun keeps the first)."""
    free, run = stem, 1
    while not overwrite and any(free.with_suffix(s).exists() for s in (".json", ".png")):
        run += 1
        free = stem.with_name(f"{stem.name}-run{run}")
    return free


def default_backends(device: torch.device) -> list[str]:
    """The upstream-style loop and every library backend available on ``device`` (Triton on CUDA only),
    each ``+out`` variant with its backend."""
    names = set(ktae_kernels.available_backends(device)) | {UPSTREAM}
    if device.type != "cuda":
        names.discard("triton")
    return [n for n in ALL_NAMES if n.removesuffix(REUSE_OUT) in names]


def settings(args: argparse.Namespace, grid_name: str, shapes, device: torch.device, names: list[str], budget) -> dict:
    """The run's settings for the JSON."""
    return {
        "preset": grid_name, "shapes": [str(sh) for sh in shapes], "device": str(device), "backends": names,
        "repeats": args.repeats, "threads": torch.get_num_threads(), "seed": args.seed, "budget": asdict(budget),
        "vocab": data.QWEN_VOCAB, "config": repr(BENCH_CONFIG), "upstream_config": "the same with fisher='upstream'",
        "data": data.__doc__.strip(),
        "timing": "wall clock around a synchronised token_advantage call; inputs already on the device; "
                  "seconds = median of the timed runs (times prompts / groups_measured when extrapolated); "
                  "a per-group loop is timed once per (G, L) on the first groups, which every P shares",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as err:
        print(f"--device: expected cpu or cuda[:N], got {args.device!r} ({err})", file=sys.stderr)
        return 2
    if device.type not in ("cpu", "cuda"):
        print(f"--device: expected cpu or cuda[:N], got {args.device!r}", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here", file=sys.stderr)
        return 2
    names = default_backends(device) if args.backends is None else [n.strip() for n in args.backends.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_NAMES]
    if unknown:
        print(f"--backends: unknown {unknown}; choose from {','.join(ALL_NAMES)}", file=sys.stderr)
        return 2
    if args.contend is not None:
        device, names = torch.device("cpu"), ["cpu"]
    budget = budget_for(device.type, args.preset)
    shapes = tuple(args.shape) if args.shape else contention.SHAPES if args.contend is not None else PRESETS[args.preset]
    grid_name = "contend" if args.contend is not None else "custom" if args.shape else args.preset
    name = (f"{machine_slug(device)}-{today()}" + ("" if grid_name == "default" else f"-{grid_name}")
            + (f"-{args.tag}" if args.tag else ""))
    stem = result_stem(args.out / name, overwrite=args.overwrite)
    batches = f"{len(shapes)} batch" + ("" if len(shapes) == 1 else "es")
    print(f"ktae_kernels bench: {batches} ({grid_name} grid) on {device}: {', '.join(names)}")
    print(f"results: {stem}.json")
    load = load_average()
    if device.type == "cpu" and load is not None and load > 0.5:
        print(f"note: the 1-minute load average is {load} on {os.cpu_count()} cores: other processes share\n"
              "the CPU, and the timings will be noisy")

    if args.contend is not None:
        return run_contend(args, shapes, stem)
    start = time.perf_counter()
    head = {"schema": "ktae_kernels.bench/1",
            "command": " ".join(["python -m bench", *(sys.argv[1:] if argv is None else argv)]),
            "machine": machine_info(device), "settings": settings(args, grid_name, shapes, device, names, budget)}

    def save(results, copy_gb_s=None, complete=False):  # after every shape, so a killed run leaves its results
        write_json(stem.with_suffix(".json"), {
            **head, "complete": complete, "results": result_json(results),
            "paper_batch": paper_summary(results, copy_gb_s, device.type), "copy_gb_s": copy_gb_s,
            "load_average_1min_at_save": load_average(),
            "wall_time_s": time.perf_counter() - start,
        })

    # The bar (stderr) is finished and closed by run_grid before the table (stdout) is printed; flushing
    # both around it keeps them apart when they share a terminal or a log file.
    sys.stdout.flush()
    results = run_grid(shapes, names, device, budget, args.repeats, args.seed,
                       progress=not args.no_progress and sys.stderr.isatty(), on_shape_done=save)
    sys.stderr.flush()
    # the copy bandwidth only serves the paper batch's "share of copy bandwidth": measure it when that ran
    paper_ran = any(r.shape == PAPER_SHAPE and r.seconds is not None for r in results)
    copy_gb_s = copy_bandwidth_gb_s(device, gbytes=4.0 if device.type == "cuda" else 1.0) if paper_ran else None
    print()
    print(format_table(results))
    print()
    print(format_paper_summary(paper_summary(results, copy_gb_s, device.type)))
    print(f"\nwall time {time.perf_counter() - start:.0f} s")
    save(results, copy_gb_s, complete=True)
    if not args.no_plot:
        info = head["machine"]
        where = info["gpu"]["name"] if info["gpu"] else f"{info['cpu_model']} ({info['cpu_cores']} cores)"
        plot(results, stem.with_suffix(".png"), f"ktae_kernels on {where}, {today()}, {grid_name} grid")
    print(f"wrote {stem}.json" + ("" if args.no_plot else " and .png"))
    return _report_mismatches(results)


def _report_mismatches(results: list[Result]) -> int:
    """1, naming each, when a library backend's advantages differ from the reference's by more than
    ``EXACT_TOLERANCE`` (or hold NaN / inf); else 0."""
    wrong = [r for r in results if r.matches_reference is False]
    for r in wrong:
        print(f"error: {r.backend} differs from the reference by {r.max_abs_diff_vs_reference:.3g} on "
              f"{shape_title(r.shape)} (more than {EXACT_TOLERANCE:g})", file=sys.stderr)
    return 1 if wrong else 0


def run_contend(args: argparse.Namespace, shapes: tuple[Shape, ...], stem: Path) -> int:
    """``--contend``: bench.contention on ``shapes``; prints its table, writes its JSON."""
    reason = unavailable_reason("cpu", torch.device("cpu"))
    if reason is not None:
        print(f"--contend: the cpu backend cannot run here: {reason}", file=sys.stderr)
        return 2
    competitor = args.contend or contention.default_competitor_threads()
    start = time.perf_counter()
    show = (lambda text: print(f"  {text}", file=sys.stderr, flush=True)) if not args.no_progress else (lambda text: None)
    results = contention.run_contention(shapes, competitor, seed=args.seed, on_progress=show)
    print()
    print(contention.format_contention(results, competitor))
    print(f"\nwall time {time.perf_counter() - start:.0f} s")
    write_json(stem.with_suffix(".json"), {
        "schema": "ktae_kernels.bench-contend/1",
        "command": " ".join(["python -m bench", *(sys.argv[1:] if args.argv is None else args.argv)]),
        "machine": machine_info(torch.device("cpu")), "seed": args.seed,
        **contention.contention_json(results, competitor), "wall_time_s": time.perf_counter() - start,
    })
    print(f"wrote {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
