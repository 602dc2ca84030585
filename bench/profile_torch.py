"""Where the torch backend's time goes, stage by stage: ``python -m bench.profile_torch``.

The stage functions of ``ktae_kernels.backends.torch`` and ``method`` (and ``validation.normalise_batch``) are wrapped
with synchronised timers for the duration of the run, then the public ``token_advantage`` is called
as usual; nested stages (those called inside another) print indented under it. Stages that a
refactor renamed are simply absent. ``--ops`` adds torch.profiler's busiest operators.

    python -m bench.profile_torch                         # G=16, 64 prompts, L=3072 on the CPU
    python -m bench.profile_torch --prompts 1024 --ops    # the paper batch
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from importlib import import_module

import torch

import ktae_kernels
from bench.contenders import BENCH_CONFIG
from bench.data import Shape, make_batch
from bench.timing import synchronize

#: module -> stage functions to time (outer stages first; a name missing from the module is skipped).
STAGES: dict[str, tuple[str, ...]] = {
    "ktae_kernels.validation": ("normalise_batch",),
    "ktae_kernels.backends.torch": ("group_stats", "build_tables", "score_tables", "combine"),
    "ktae_kernels.method": ("table_statistics", "exact_pvalue_flat", "information_gain", "cohen_h", "tf_ratio",
                            "squash", "rollout_advantage"),
}


#: the time outside every timed top-level stage (dispatch, result objects), as a pseudo-stage.
OTHER = ("other (dispatch, glue)",)


@contextmanager
def stage_timers(device: torch.device):
    """Wrap the ``STAGES`` functions; yields a dict ``path tuple -> list of seconds`` filled per call."""
    times: dict[tuple[str, ...], list[float]] = defaultdict(list)
    stack: list[str] = []
    saved = []

    def wrap(name, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            stack.append(name)
            synchronize(device)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                synchronize(device)
                times[tuple(stack)].append(time.perf_counter() - start)
                stack.pop()
        return timed

    for module_name, names in STAGES.items():
        module = import_module(module_name)
        for name in names:
            if callable(getattr(module, name, None)):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, wrap(name, getattr(module, name)))
    try:
        yield times
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def profile_stages(shape: Shape, device: torch.device, repeats: int, seed: int = 0) -> tuple[float, dict]:
    """Median end-to-end seconds of ``token_advantage(backend="torch")`` and, per stage path, the
    median over runs of its total seconds per run (``OTHER``: the rest of each run)."""
    batch = make_batch(shape, seed=seed, device=device)
    run = lambda: ktae_kernels.token_advantage(*batch.args(), config=BENCH_CONFIG, backend="torch")  # noqa: E731
    run()  # warm-up
    totals, per_stage = [], defaultdict(list)
    for _ in range(repeats):
        with stage_timers(device) as times:
            synchronize(device)
            start = time.perf_counter()
            run()
            synchronize(device)
            totals.append(time.perf_counter() - start)
        for path, secs in times.items():
            per_stage[path].append(sum(secs))
        per_stage[OTHER].append(totals[-1] - sum(sum(v) for p, v in times.items() if len(p) == 1))
    return statistics.median(totals), {p: statistics.median(v) for p, v in per_stage.items()}


def format_stages(total: float, stages: dict) -> str:
    """The stage tree with ms and share of the end-to-end time."""
    lines = [f"{'stage':<36}{'ms':>10}{'share':>8}"]
    for path in sorted(stages, key=_order):
        label = "  " * (len(path) - 1) + path[-1]
        lines.append(f"{label:<36}{stages[path] * 1e3:>10.1f}{stages[path] / total:>8.1%}")
    lines.append(f"{'end to end (token_advantage)':<36}{total * 1e3:>10.1f}{1:>8.0%}")
    return "\n".join(lines)


def _order(path: tuple[str, ...]) -> tuple:
    flat = [n for names in STAGES.values() for n in names] + [OTHER[0]]
    return tuple(flat.index(n) if n in flat else len(flat) for n in path)


def top_ops(shape: Shape, device: torch.device, seed: int = 0, rows: int = 15) -> str:
    """torch.profiler's operators by self time for one ``token_advantage`` call."""
    from torch.profiler import ProfilerActivity, profile

    batch = make_batch(shape, seed=seed, device=device)
    ktae_kernels.token_advantage(*batch.args(), config=BENCH_CONFIG, backend="torch")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        ktae_kernels.token_advantage(*batch.args(), config=BENCH_CONFIG, backend="torch")
        synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_torch", description=__doc__.split("\n\n")[0])
    p.add_argument("--G", type=int, default=16)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--L", type=int, default=3072)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--ops", action="store_true", help="also print torch.profiler's busiest operators")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    shape, device = Shape(args.G, args.prompts, args.L), torch.device(args.device)
    total, stages = profile_stages(shape, device, args.repeats)
    print(f"torch backend on {shape} ({device}, {torch.get_num_threads()} threads), median of {args.repeats}:")
    print(format_stages(total, stages))
    if args.ops:
        print()
        print(top_ops(shape, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
