"""GPU correctness and timing of the triton and cuda backends against the torch backend, on one device.

The checks a first hardware run needs, in one process, through the public API only (``bench/gpu.sh``
runs it with a timeout). Each compares against ``backend="torch"`` on the same device: advantages to
1e-6, ``key_token_scores``' integer columns exactly and its float columns to 1e-9.
- ``paper``: the paper batch (1024 prompts x G = 16 x L = 3072, ``bench.data``); then its timings;
- ``diverse``: groups of 64 x 4096 uniform ids over 30k (thousands of distinct ids per group, raced by
  many programs; the cuda shared tables overflow); ``hot``: almost every token one of 4 ids;
- ``overflow``: tables forced far too small (``TritonTuning``, ``CudaTuning``): the rebuilds and the
  global pass;
- ``upstream``: ``fisher="upstream"``; ``stream``: a non-default stream with work queued ahead and
  ``out=``; ``devices``: tensors on the last GPU while GPU 0 is current (with two GPUs);
- ``ids``: an out-of-range id raises ValueError and leaves ``out`` untouched;
- ``graph``: a plan captured in a CUDA graph after a warm-up, replayed on new ids, ``check()`` after;
  then ``REPLAYS`` replays timed, each between CUDA events with the device idle before it (median,
  quartiles, min and max);
- ``repeat``: 5 runs bit for bit the same (races); ``tuning``: every launch variant the timings use;
- ``G128``, ``G1024``: groups of 128 and 1024 rollouts.

Timings (CUDA events, median of ``--repeats``): each backend's call on the paper batch with ``out=``
(tables sized by what the earlier calls learnt), its first call of a layout (what the calls learnt
forgotten first, ``DeviceState.clear(cached=False)``: tables sized by masked tokens), the host time to enqueue it, each kernel's share (the torch
profiler), the tuning variants, and the bandwidth of the unavoidable I/O against a device copy.

The report, ``<out>/<device>-<date>-gpu-check.json``, is written (whole, through a temporary file) after
every check and timing, so a run cut by its timeout keeps what it measured; exit status 1 when a check failed. ``--dry-run`` runs tiny
shapes on the CPU (Triton interpreter; no cuda backend) to check the script.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

if "--dry-run" in sys.argv:  # the Triton interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from bench.data import Shape, make_batch  # noqa: E402
from bench.machine import machine_info, machine_slug, today  # noqa: E402
from bench.paper import copy_bandwidth_gb_s, io_bytes  # noqa: E402
from ktae_kernels import (CudaTuning, ExecutionOptions, KTAEConfig, TritonTuning, available_backends,  # noqa: E402
                          key_token_scores, plan_token_advantage, token_advantage)
from ktae_kernels.backends.device import state  # noqa: E402

#: launch variants timed (and checked): per backend, a name and its options. A cuda variant is named by
#: the threads its blocks run on the paper batch (a rollout of L = 3072 split into passes of whole warps
#: x 4 positions: a cap of 384 runs two passes of 384, 768 one pass of 768).
VARIANTS = {
    "cuda": {f"threads{t}-sm{b}-{'packed' if p else 'wide'}": ExecutionOptions(
        cuda=CudaTuning(max_threads=t, blocks_per_sm=b, packed=p))
        for t, b, p in ((256, 1, True), (384, 1, True), (768, 1, True), (768, 1, False), (384, 2, True))},
    "triton": {f"guess{g}": ExecutionOptions(triton=TritonTuning(first_guess=g)) for g in (0.125, 0.25, 0.5)},
}
#: tables far too small: every group rebuilt (triton) or taken by the global pass (cuda)
TINY = ExecutionOptions(triton=TritonTuning(first_guess=0.005, max_first_slots=16),
                        cuda=CudaTuning(table_slots=32))
#: graph replays timed per backend
REPLAYS = 20
INT_COLUMNS = ("group", "token", "a", "b", "c", "d", "f_c", "f_w")
REAL_COLUMNS = ("p_value", "F", "IG", "x", "score")
ADVANTAGE_ATOL = 1e-6
REAL_RTOL = 1e-9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench-results"),
                   help="output folder (default ./bench-results/, git-ignored)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    p.add_argument("--skip-timings", action="store_true")
    args = p.parse_args(argv)

    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --dry-run to check the script on the CPU)", file=sys.stderr)
        return 2
    backends = [b for b in ("triton", "cuda") if b in available_backends(device)]
    print(f"device {device}, backends under test: {backends}", flush=True)
    small = args.dry_run
    paper = Shape(4, 3, 64) if small else Shape(16, 1024, 3072)
    report: dict[str, Any] = {"machine": machine_info(device), "date": today(), "backends": backends,
                              "paper_shape": str(paper), "checks": {}, "timings": {}}
    stem = args.out / f"{machine_slug(device)}-{today()}-gpu-check{'-dry-run' if small else ''}"
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        """Write what is measured so far: a stage killed by its timeout keeps it (the last whole file)."""
        partial = stem.with_suffix(".json.part")
        partial.write_text(json.dumps(report, indent=2, default=str))
        os.replace(partial, stem.with_suffix(".json"))

    def check(name: str, fn: Callable[[], dict]) -> None:
        t0 = time.perf_counter()
        try:
            result = {"ok": True, **fn()}
        except Exception as err:  # a failed check is recorded; the others still run
            result = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - t0, 3)
        report["checks"][name] = result
        print(f"[{'ok' if result['ok'] else 'FAIL'}] {name} ({result['seconds']} s)"
              + ("" if result["ok"] else f": {result['error']}"), flush=True)
        save()

    paper_batch = make_batch(paper, device=device, seed=0).args()
    check("paper", lambda: compare_all(paper_batch, backends, KTAEConfig()))
    if not args.skip_timings:
        with contextlib.suppress(Exception):
            timings(paper_batch, backends, args.repeats, device, report["timings"], save)
    diverse = uniform_batch(groups=2 if small else 16, G=8 if small else 64, L=64 if small else 4096,
                            vocab=300 if small else 30_000, device=device, seed=1)
    check("diverse", lambda: compare_all(diverse, backends, KTAEConfig()))
    hot = hot_batch(groups=2 if small else 8, G=4 if small else 16, L=64 if small else 8192, device=device)
    check("hot", lambda: compare_all(hot, backends, KTAEConfig()))
    check("overflow", lambda: compare_all(diverse, backends, KTAEConfig(), TINY))
    upstream = make_batch(Shape(16, 2 if small else 64, 64 if small else 3072), device=device, seed=2).args()
    check("upstream", lambda: compare_all(upstream, backends, KTAEConfig(fisher="upstream")))
    if device.type == "cuda":
        check("stream", lambda: non_default_stream(paper_batch, backends))
        if torch.cuda.device_count() > 1:
            check("devices", lambda: other_device(backends))
        check("graph", lambda: graph_capture(paper_batch, backends))
    check("ids", lambda: bad_ids(diverse, backends))
    check("repeat", lambda: repeat_and_compare([diverse, hot], backends))
    check("tuning", lambda: tuning_variants(diverse if small else paper_batch, backends))
    for G, groups, L in ((128, 2, 8), (1024, 1, 3)) if small else ((128, 32, 1024), (1024, 16, 192)):
        big = uniform_batch(groups=groups, G=G, L=L, vocab=60 if small else 30_000, device=device, seed=G)
        check(f"G{G}", lambda: compare_all(big, backends, KTAEConfig()))
    save()
    failed = [name for name, r in report["checks"].items() if not r["ok"]]
    print(f"wrote {stem}.json; {len(report['checks']) - len(failed)}/{len(report['checks'])} checks passed"
          + (f"; FAILED: {failed}" if failed else ""), flush=True)
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------ batches
def uniform_batch(groups: int, G: int, L: int, vocab: int, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    B = groups * G
    responses = torch.randint(0, vocab, (B, L), generator=gen)
    lengths = torch.randint(L // 4, L + 1, (B,), generator=gen)
    mask = torch.arange(L)[None, :] < lengths[:, None]
    rewards = (torch.rand(B, generator=gen) < 0.5).float()
    index = torch.arange(B) // G
    return tuple(t.to(device) for t in (responses, mask, rewards, index))


def hot_batch(groups: int, G: int, L: int, device: torch.device):
    gen = torch.Generator().manual_seed(3)
    B = groups * G
    responses = torch.randint(0, 4, (B, L), generator=gen)
    rare = torch.rand(B, L, generator=gen) < 0.001
    responses[rare] = torch.randint(4, 151_936, (int(rare.sum()),), generator=gen)
    mask = torch.ones(B, L, dtype=torch.bool)
    rewards = (torch.arange(B) % 3 == 0).float()
    index = torch.arange(B) // G
    return tuple(t.to(device) for t in (responses, mask, rewards, index))


# ---------------------------------------------------------------------------------------- comparisons
def compare_scores(want, got) -> dict:
    if len(want) != len(got):
        raise AssertionError(f"{len(got)} rows, torch has {len(want)}")
    for col in INT_COLUMNS:
        if not torch.equal(getattr(want, col), getattr(got, col)):
            raise AssertionError(f"integer column {col} differs")
    diffs = {}
    for col in REAL_COLUMNS:
        w, g = getattr(want, col).double(), getattr(got, col).double()
        diffs[col] = float(((w - g).abs() / w.abs().clamp(min=1.0)).max()) if len(want) else 0.0
        if diffs[col] > REAL_RTOL:
            raise AssertionError(f"column {col} differs by {diffs[col]:.3g} > {REAL_RTOL}")
    return {"rows": len(want), "max_real_diff": diffs}


def compare_advantage(want: torch.Tensor, got: torch.Tensor) -> float:
    if got.shape != want.shape or got.dtype != torch.float32 or got.device != want.device:
        raise AssertionError(f"advantage {got.dtype} {tuple(got.shape)} on {got.device}")
    diff = float((want - got).abs().max()) if want.numel() else 0.0
    if diff > ADVANTAGE_ATOL:
        raise AssertionError(f"advantages differ by {diff:.3g} > {ADVANTAGE_ATOL}")
    return diff


def compare_all(args, backends: list[str], config: KTAEConfig, options: ExecutionOptions | None = None) -> dict:
    want_adv = token_advantage(*args, config=config, backend="torch")
    want_rows = key_token_scores(*args, config=config, backend="torch")
    out: dict[str, Any] = {"rows": len(want_rows)}
    for name in backends:
        got = token_advantage(*args, config=config, backend=name, options=options)
        rows = key_token_scores(*args, config=config, backend=name, options=options)
        out[name] = {"advantage_max_diff": compare_advantage(want_adv, got), **compare_scores(want_rows, rows)}
    return out


def non_default_stream(args, backends: list[str]) -> dict:
    want = token_advantage(*args, backend="torch")
    out = {}
    for name in backends:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            busy = torch.randn(4096, 4096, device="cuda")
            for _ in range(8):
                busy = busy @ busy  # work queued ahead of the call on this stream
            responses = args[0].clone()
            result = torch.empty(responses.shape, dtype=torch.float32, device="cuda")
            got = token_advantage(responses, *args[1:], backend=name, out=result)
        torch.cuda.current_stream().wait_stream(stream)
        assert got.data_ptr() == result.data_ptr()
        out[name] = compare_advantage(want, got)
    return out


def other_device(backends: list[str]) -> dict:
    last = torch.device("cuda", torch.cuda.device_count() - 1)
    args = uniform_batch(groups=4, G=16, L=512, vocab=5000, device=last, seed=5)
    want = token_advantage(*args, backend="torch")
    out = {}
    for name in backends:
        with torch.cuda.device(0):
            got = token_advantage(*args, backend=name)
        assert got.device == last
        out[name] = compare_advantage(want, got)
    return out


def bad_ids(args, backends: list[str]) -> dict:
    responses = args[0].clone()
    mask = args[1].clone()
    responses[1, 0], mask[1, 0] = -3, True
    for name in backends:
        out = torch.full(responses.shape, 7.0, device=responses.device)
        try:
            token_advantage(responses, mask, *args[2:], backend=name, out=out)
        except ValueError as err:
            assert "found -3" in str(err), err
        else:
            raise AssertionError(f"{name}: no ValueError for id -3")
        assert bool((out == 7.0).all()), f"{name} wrote `out` before raising"
    return {}


def graph_capture(args, backends: list[str]) -> dict:
    """A plan's call with ``out=`` captured in a CUDA graph after a warm-up on a side stream, replayed
    on new ids copied into the captured tensors, ``check()`` after each, against torch; then its replays
    timed (``replay_times``)."""
    responses, mask, rewards, index = args
    out_times = {}
    for name in backends:
        plan = plan_token_advantage(index, tuple(responses.shape), device=responses.device, backend=name)
        static = [responses.clone(), mask.clone(), rewards.double()]
        out = torch.empty(responses.shape, dtype=torch.float32, device=responses.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                plan(*static, out=out)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            plan(*static, out=out)
        for shift in (7, 11):
            shifted = (responses + shift) % 151_936
            static[0].copy_(shifted)
            graph.replay()
            torch.cuda.synchronize()
            plan.check()
            compare_advantage(token_advantage(shifted, mask, rewards, index, backend="torch"), out)
        out_times[name] = replay_times(graph)
        plan.check()
    return {"replay_s": out_times}


def replay_times(graph, samples: int = REPLAYS) -> dict[str, float]:
    """Seconds of ``samples`` replays of ``graph`` (``event_times``)."""
    return event_times(graph.replay, samples)


def event_times(fn: Callable[[], Any], samples: int) -> dict[str, float]:
    """Seconds of ``samples`` calls of ``fn``: each between two CUDA events, the device synchronised
    (idle) before it, so that nothing queued earlier is timed (on the CPU: wall time). The median,
    quartiles, min and max."""
    times = []
    for _ in range(samples):
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    q1, median, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return {"median": median, "q1": q1, "q3": q3, "min": min(times), "max": max(times), "samples": samples}


def repeat_and_compare(batches: list[tuple], backends: list[str], runs: int = 5) -> dict:
    for args in batches:
        for name in backends:
            first = token_advantage(*args, backend=name)
            for _ in range(runs - 1):
                if not torch.equal(first, token_advantage(*args, backend=name)):
                    raise AssertionError(f"{name}: two runs differ (a race)")
    return {"runs": runs}


def tuning_variants(args, backends: list[str]) -> dict:
    want = token_advantage(*args, backend="torch")
    return {name: {variant: compare_advantage(want, token_advantage(*args, backend=name, options=options))
                   for variant, options in VARIANTS[name].items()} for name in backends}


# -------------------------------------------------------------------------------------------- timings
def device_time(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None) -> float:
    """Median seconds of ``fn`` between CUDA events (after one warm-up), or wall time on the CPU;
    ``before`` runs untimed ahead of each call."""
    fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET"):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_shares(fn: Callable[[], Any]) -> dict[str, float]:
    """Microseconds of device time per kernel name in one call of ``fn`` (the torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key[:80]: round(e.device_time_total, 1) for e in prof.key_averages() if e.device_time_total > 0}


def timings(args, backends: list[str], repeats: int, device: torch.device, result: dict[str, Any],
            save: Callable[[], None]) -> None:
    """The paper batch's timings into ``result``, saved after each backend."""
    positions = args[0].numel()
    out = torch.empty(args[0].shape, dtype=torch.float32, device=device)
    copy = copy_bandwidth_gb_s(device, gbytes=4.0 if device.type == "cuda" else 0.05)
    result.update({"copy_gb_s": copy, "io_bytes": io_bytes(positions), "backends": {}})
    save()
    for name in ["torch", *backends]:
        call = lambda options=None: token_advantage(*args, backend=name, out=out, options=options)  # noqa: E731
        seconds = device_time(call, repeats)
        row: dict[str, Any] = {"call_s": seconds, "achieved_gb_s": io_bytes(positions) / seconds / 1e9,
                               "share_of_copy": io_bytes(positions) / seconds / 1e9 / copy}
        if name != "torch":
            row["first_call_s"] = device_time(call, max(3, repeats // 4),
                                              before=lambda: state(device).clear(cached=False))
            row["host_s"] = host_time(call, repeats)
            row["variants_s"] = {v: device_time(lambda o=o: call(o), max(3, repeats // 4))
                                 for v, o in VARIANTS[name].items()}
            if device.type == "cuda":
                with contextlib.suppress(Exception):
                    row["kernels_us"] = kernel_shares(call)
        result["backends"][name] = row
        save()
        print(f"  {name:<7} {1e3 * seconds:8.3f} ms, {row['achieved_gb_s']:.0f} GB/s "
              f"({100 * row['share_of_copy']:.1f}% of copy)", flush=True)


def host_time(call: Callable[[], Any], repeats: int) -> float:
    """Median wall seconds of a call with the device idle before it: the host's share (validation,
    planning, launches, the final flag read's wait for its own kernels excepted: an upper bound)."""
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
