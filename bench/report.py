"""Results as a text table, a JSON document and a PNG plot.

Columns: ``time`` is the median wall time of the whole batch (``~``: extrapolated from the first
groups); ``Mtok/s`` counts real (masked) response tokens; ``x ref`` / ``x upstream`` are the
speed-ups against the scipy reference and the upstream-style loop on the same batch (``~`` when
either side is extrapolated); ``x floor`` is the time over the machine's memory floor for the same
batch, measured in the same run (``bench.floor``: one read of ids and mask, one float32 write; the
fastest of its samples, ``bench.floor_stats``), and ``error`` where a time came out under the floor
(a disturbed measurement, never a result); ``peak MB`` is the extra memory of one call at its peak
(output included); ``max|d| ref`` is the largest difference from the reference's advantages on the
groups both ran. The table prints one block per batch (``G x P x L``, as ``--shape`` takes it), and
under it a legend of every mark and dash its cells show (``LEGEND``), so that it reads alone.
"""
from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

from bench.contenders import REUSE_OUT, UPSTREAM
from bench.data import Shape
from bench.floor_stats import MIN_FLOOR_POSITIONS
from bench.runner import Result

COLUMNS = ("backend", "time", "Mtok/s", "x ref", "x upstream", "x floor", "peak MB", "max|d| ref", "note")
#: the widest line the table and its notes aim for.
WIDTH = 98


def speedups(results: list[Result]) -> dict[tuple, dict]:
    """``(shape, backend) -> {"vs_reference", "vs_upstream"}``: the speed-up (None where a side is
    missing) and, under ``"<key>_extrapolated"``, whether either side is extrapolated."""
    by_key = {(r.shape, r.backend): r for r in results}
    out = {}
    for r in results:
        row: dict = {}
        for key, base in (("vs_reference", "reference"), ("vs_upstream", UPSTREAM)):
            b = by_key.get((r.shape, base))
            ok = r.seconds is not None and b is not None and b.seconds is not None
            row[key] = b.seconds / r.seconds if ok else None
            row[f"{key}_extrapolated"] = bool(ok and (b.extrapolated or r.extrapolated))
        out[(r.shape, r.backend)] = row
    return out


def format_number(value: float) -> str:
    """The one number format of the bench's output: three significant digits in fixed point, whole
    numbers from 100 up, thousands separated, no trailing zeros (``0.00902``, ``0.56``, ``63.2``,
    ``100``, ``1,001``, ``21,532``; never ``1e+03``)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))
    text = f"{value:,.{decimals}f}"
    if decimals and len(text.replace(",", "").replace(".", "").lstrip("-0")) > 3:
        text = f"{value:,.{decimals - 1}f}"  # rounding carried into one more digit: 9.996 -> 10.00
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_time(seconds: float | None) -> str:
    """Seconds as ``812 us``, ``12.3 ms``, ``4.56 s`` or ``2,260 s`` (``format_number``)."""
    if seconds is None:
        return "-"
    if seconds < 0.9995e-3:
        return f"{format_number(seconds * 1e6)} us"
    if seconds < 0.9995:
        return f"{format_number(seconds * 1e3)} ms"
    return f"{format_number(seconds)} s"


def format_ratio(value: float) -> str:
    """``0.25x``, ``63.2x``, ``1,001x``: ``format_number`` and an ``x``, in every ratio column and in
    the paper batch's summary."""
    return format_number(value) + "x"


def _speedup(value: float | None, extrapolated: bool) -> str:
    return "-" if value is None else ("~" if extrapolated else "") + format_ratio(value)


def format_diff(value: float | None) -> str:
    """``max|d| ref``: ``0`` when exact, else two digits in scientific notation (``1.9e-01``)."""
    return "-" if value is None else "0" if value == 0 else f"{value:.1e}"


def shape_title(shape: Shape) -> str:
    """A batch as ``python -m bench --shape`` takes it: ``16 x 1024 x 3072`` (G x P x L)."""
    return f"{shape.G} x {shape.prompts} x {shape.L}{shape.variant}"


#: the notes printed under the table, in this order, each only when a printed cell needs it.
LEGEND = {
    "shape": ("G x P x L", "rollouts per group x prompts x padded response length (as --shape takes it)"),
    "reuse_out": ("cpu+out", "the cpu backend writing into one out= buffer reused across calls, as a "
                             "trainer can; cpu returns a new output at every call"),
    "extrapolated": ("~", "extrapolated linearly from the first groups of the batch (per-group Python "
                          "loops; the numbered note says how many)"),
    "not_timed": ("-", "a row that was not timed: its numbered note says why"),
    "no_reference": ("x ref -", "the reference did not run on this batch (not in --backends, skipped "
                                "or failed); max|d| ref is '-' too"),
    "no_upstream": ("x upstream -", "the upstream-style loop did not run on this batch"),
    "floor_small": ("x floor -", f"batch under {MIN_FLOOR_POSITIONS:,} positions (B x L): its floor pass takes "
                                 "microseconds, under the timer's noise, so it is not measured"),
    "floor_extrapolated": ("x floor -", "an extrapolated time is not compared with the floor of the "
                                        "whole batch"),
    "floor_none": ("x floor -", "no floor in this run: it is measured on the CPU only, where the native "
                                "floor pass builds (with OpenMP for several threads), on a batch every "
                                "backend ran"),
    "floor_error": ("x floor error", "measured faster than the memory floor of the same batch, which no "
                                     "code can be: other processes disturbed the timings. Rerun on a "
                                     "quieter machine."),
    "peak_loops": ("peak MB -", "not measured for the per-group Python loops (reference, "
                                "upstream-style)"),
    "peak_none": ("peak MB -", "the resident-set peak cannot be read here (/proc/self/clear_refs)"),
    "peak_zero": ("peak MB 0", "under 0.5 MB"),
    "diff_self": ("max|d| ref -", "on the reference's own row"),
    "diff_upstream": ("max|d| ref", "on the upstream-style rows is expected: that loop runs "
                                    "fisher=\"upstream\", the published float32 Fisher, against the exact "
                                    "float64 reference (docs/fisher.md); the library backends' figure is the "
                                    "check"),
    "columns": ("columns", "what each one means: docs/benchmarks.md#columns"),
}


def _cells(r: Result, sp: dict) -> tuple[tuple[str, ...], set[str]]:
    """The row of a result (without its note) and the legend keys its cells need."""
    keys: set[str] = set()
    if r.status != "ok":
        return (r.backend, r.status, *["-"] * 6), {"not_timed"}
    if r.extrapolated or sp["vs_reference_extrapolated"] or sp["vs_upstream_extrapolated"]:
        keys.add("extrapolated")
    if sp["vs_reference"] is None:
        keys.add("no_reference")
    if sp["vs_upstream"] is None:
        keys.add("no_upstream")
    if r.floor_error:
        keys.add("floor_error")
    elif r.x_floor is None:
        keys.add("floor_extrapolated" if r.extrapolated else "floor_small"
                 if r.shape.positions < MIN_FLOOR_POSITIONS else "floor_none")
    if r.backend.endswith(REUSE_OUT):
        keys.add("reuse_out")
    if r.peak_extra_bytes is None:
        keys.add("peak_loops" if r.backend in ("reference", UPSTREAM) else "peak_none")
    elif round(r.peak_extra_bytes / 1e6) == 0:
        keys.add("peak_zero")
    if r.backend == "reference":
        keys.add("diff_self")
    elif r.backend == UPSTREAM and r.max_abs_diff_vs_reference is not None:
        keys.add("diff_upstream")
    time = ("~" if r.extrapolated else "") + format_time(r.seconds)
    rate = format_number(r.tokens_per_s / 1e6) if r.tokens_per_s else "-"
    floor = "error" if r.floor_error else format_ratio(r.x_floor) if r.x_floor else "-"
    peak = f"{r.peak_extra_bytes / 1e6:,.0f}" if r.peak_extra_bytes is not None else "-"
    return (r.backend, time, rate, _speedup(sp["vs_reference"], sp["vs_reference_extrapolated"]),
            _speedup(sp["vs_upstream"], sp["vs_upstream_extrapolated"]), floor, peak,
            format_diff(r.max_abs_diff_vs_reference)), keys


def format_legend(keys: set[str], width: int = WIDTH) -> list[str]:
    """The legend's lines for ``keys`` (see ``LEGEND``), in its order, wrapped to ``width``."""
    chosen = [LEGEND[k] for k in LEGEND if k in keys]
    if not chosen:
        return []
    pad = max(len(label) for label, _ in chosen) + 2
    lines = []
    for label, text in chosen:
        lines += textwrap.wrap(text, width, initial_indent=label.ljust(pad), subsequent_indent=" " * pad)
    return lines


def format_table(results: list[Result]) -> str:
    """A fixed-width text table, one block per batch (titled ``G x P x L``), then a legend of the
    marks and dashes that its cells show, and the numbered notes of single cells."""
    ups = speedups(results)
    notes: list[str] = []
    keys: set[str] = {"shape", "columns"} if results else set()
    rows = []
    for r in results:
        cells, cell_keys = _cells(r, ups[(r.shape, r.backend)])
        keys |= cell_keys
        note = ""
        if r.note:
            if r.note not in notes:
                notes.append(r.note)
            note = f"[{notes.index(r.note) + 1}]"
        rows.append((*cells, note))
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]
    line = lambda cells: "  ".join(c.ljust(w) if i in (0, 8) else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = [line(COLUMNS), line(tuple("-" * w for w in widths))]
    previous = None
    for r, row in zip(results, rows):
        if r.shape != previous:
            floor = f"; memory floor {format_time(r.floor_s)}" if r.floor_s else ""
            tokens = f": {r.tokens:,} real tokens" if r.tokens else ""
            out += ["", f"{shape_title(r.shape)}{tokens}{floor}"]
        out.append(line(row))
        previous = r.shape
    legend = format_legend(keys)
    out += ["", *legend] if legend else []
    for i, n in enumerate(notes):
        out += textwrap.wrap(n, WIDTH, initial_indent=f"[{i + 1}] ", subsequent_indent=" " * (len(str(i + 1)) + 3))
    return "\n".join(out)


def result_json(results: list[Result]) -> list[dict]:
    """JSON-ready rows, speed-ups included."""
    ups = speedups(results)
    rows = []
    for r in results:
        sp = ups[(r.shape, r.backend)]
        rows.append({
            "G": r.shape.G, "prompts": r.shape.prompts, "L": r.shape.L, "B": r.shape.B, "shape": str(r.shape),
            "spread_ids": r.shape.spread_ids, "masked": r.shape.masked,
            "positions": r.shape.positions, "tokens": r.tokens, "backend": r.backend, "status": r.status,
            "note": r.note, "seconds": r.seconds, "extrapolated": r.extrapolated, "groups_measured": r.groups,
            "samples_s": r.samples_s, "tokens_per_s": r.tokens_per_s,
            "speedup_vs_reference": sp["vs_reference"], "speedup_vs_upstream": sp["vs_upstream"],
            "speedup_vs_reference_extrapolated": sp["vs_reference_extrapolated"],
            "speedup_vs_upstream_extrapolated": sp["vs_upstream_extrapolated"],
            "max_abs_diff_vs_reference": r.max_abs_diff_vs_reference, "matches_reference": r.matches_reference,
            "memory_floor_s": r.floor_s, "memory_floor_samples_s": r.floor_samples_s, "x_memory_floor": r.x_floor,
            "x_memory_floor_error": r.floor_error, "peak_extra_bytes": r.peak_extra_bytes,
        })
    return rows


def write_json(path: Path, payload: dict) -> None:
    """``payload`` as indented JSON (NaN/inf written as null)."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(payload), indent=1) + "\n", encoding="utf-8")


def plot(results: list[Result], path: Path, title: str) -> None:
    """Time vs real tokens per backend (left) and speed-up over the upstream-style loop (right);
    hollow markers are extrapolated; each batch shape is labelled ``G,L`` (its number of prompts
    P is what moves it along the token axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ups = speedups(results)
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(14, 5.6))
    labels: dict = {ax_t: [], ax_s: []}
    names = list(dict.fromkeys(r.backend for r in results))
    for i, name in enumerate(names):
        rows = sorted((r for r in results if r.backend == name and r.seconds), key=lambda r: r.tokens)
        if not rows:
            continue
        color = f"C{i}"
        ax_t.plot([r.tokens for r in rows], [r.seconds for r in rows], "-", color=color, alpha=0.4)
        for r in rows:
            ax_t.plot(r.tokens, r.seconds, "o", color=color, mfc="none" if r.extrapolated else color)
        ax_t.plot([], [], "o-", color=color, label=name)
        if name != UPSTREAM:
            pts = [(r, ups[(r.shape, name)]) for r in rows if ups[(r.shape, name)]["vs_upstream"]]
            for r, sp in pts:
                hollow = sp["vs_upstream_extrapolated"]
                ax_s.plot(r.tokens, sp["vs_upstream"], "o", color=color, mfc="none" if hollow else color)
                if name != "reference":
                    labels[ax_s].append(_label_shape(ax_s, r, sp["vs_upstream"]))
            if pts:
                ax_s.plot([], [], "o", color=color, label=name)
    # each shape once on the time panel, above its slowest point
    slowest: dict = {}
    for r in results:
        if r.seconds and (r.shape not in slowest or r.seconds > slowest[r.shape].seconds):
            slowest[r.shape] = r
    for r in slowest.values():
        labels[ax_t].append(_label_shape(ax_t, r, r.seconds, rotate=True))
    ax_t.plot([], [], "o", color="grey", mfc="none", label="hollow: extrapolated")
    ax_t.set(xscale="log", yscale="log", xlabel="real response tokens in the batch", ylabel="median time (s)",
             title="token_advantage end to end (labels: G,L)")
    ax_s.axhline(100, color="grey", ls="--", lw=1, label="dashed: 100x faster than the upstream-style loop")
    ax_s.set(xscale="log", yscale="log", xlabel="real response tokens in the batch",
             ylabel="speed-up over the upstream-style loop (x)",
             title="speed-up over the upstream-style loop (labels: G,L)")
    for ax, room in ((ax_t, 10.0), (ax_s, 2.0)):
        ax.grid(True, which="both", alpha=0.3)
        low, high = ax.get_ylim()
        ax.set_ylim(low, high * room)  # headroom for the labels (log axes)
    ax_t.legend(fontsize=8, loc="upper left")
    # below the axes, off the points
    ax_s.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=2, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    for ax, texts in labels.items():
        drop_overlapping(texts, keep_clear=[ax.get_legend()])
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


#: the least room around a point label, in pixels (glyph boxes are tight: touching labels read as one).
LABEL_GAP_PX = 3


def drop_overlapping(texts: list, keep_clear: list = ()) -> int:
    """Remove every text that would overlap an earlier kept one or an artist of ``keep_clear`` (a
    legend), so that the labels left are all readable; returns how many were removed. Call it once
    the figure's layout is final."""
    if not texts:
        return 0
    texts[0].figure.canvas.draw()  # final limits and positions (autoscaling is lazy)
    renderer = texts[0].figure.canvas.get_renderer()
    taken = [artist.get_window_extent(renderer) for artist in keep_clear if artist is not None]
    removed = 0
    for text in texts:
        box = text.get_window_extent(renderer).padded(LABEL_GAP_PX)
        if any(box.overlaps(other) for other in taken):
            text.remove()
            removed += 1
        else:
            taken.append(box)
    return removed


def _label_shape(ax, r: Result, y: float, rotate: bool = False):
    """A small ``G,L`` label above the point ``(r.tokens, y)`` (slanted where points crowd)."""
    return ax.annotate(f"{r.shape.G},{r.shape.L}", (r.tokens, y), xytext=(2, 5) if rotate else (0, 5),
                textcoords="offset points", ha="left" if rotate else "center", va="bottom", fontsize=6,
                color="#444", rotation=50 if rotate else 0, rotation_mode="anchor")


def markdown(payload: dict) -> str:
    """A README-ready markdown table of a results JSON, one row per shape: each backend's time, then
    each fast backend's speed-up over the reference and the upstream-style loop
    (``python -m bench.report FILE.json``)."""
    m = payload["machine"]
    where = m["gpu"]["name"] if m.get("gpu") else f"{m['cpu_model']}, {m['cpu_cores']} cores, {m['torch_threads']} threads"
    rows: dict[tuple, dict] = {}
    for r in payload["results"]:
        rows.setdefault((r["G"], r["prompts"], r["L"]), {})[r["backend"]] = r
    names = list(dict.fromkeys(r["backend"] for r in payload["results"]))
    fast = [n for n in names if n not in ("reference", UPSTREAM)]
    head = ["G", "P", "L", "tokens", *names, *(f"{n} x ref" for n in fast), *(f"{n} x upstream" for n in fast),
            "max abs diff vs ref"]
    lines = [f"{where}; torch {m['torch']}; {m['date'][:10]}; `{payload['command']}`; load average "
             f"{m.get('load_average_1min')} at the start, {payload.get('load_average_1min_at_save')} at the end; "
             f"wall time {payload['wall_time_s']:.0f} s.", "",
             "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for (G, P, L), cells in rows.items():
        tokens = next(iter(cells.values()))["tokens"]
        times = [_cell_time(cells.get(n)) for n in names]
        x_ref = [_speedup(cells[n]["speedup_vs_reference"], cells[n]["speedup_vs_reference_extrapolated"])
                 if n in cells else "-" for n in fast]
        x_up = [_speedup(cells[n]["speedup_vs_upstream"], cells[n]["speedup_vs_upstream_extrapolated"])
                if n in cells else "-" for n in fast]
        diffs = [cells[n]["max_abs_diff_vs_reference"] for n in fast if n in cells]
        diffs = [d for d in diffs if d is not None]
        diff = format_diff(max(diffs)) if diffs else "-"
        lines.append("| " + " | ".join([str(G), str(P), str(L), f"{tokens:,}", *times, *x_ref, *x_up, diff]) + " |")
    lines += ["", "`~`: extrapolated linearly from the first groups (per-group Python loops; the JSON says how "
              "many); `skipped`: over the run's caps (the JSON gives the reason); max abs diff vs ref: the "
              f"largest difference of {', '.join(fast)} from the reference's advantages on the groups both ran."]
    return "\n".join(lines)


def _cell_time(r: dict | None) -> str:
    if r is None:
        return "-"
    return ("~" if r["extrapolated"] else "") + format_time(r["seconds"]) if r["status"] == "ok" else r["status"]


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.report", description="Print a results JSON as markdown.")
    p.add_argument("json", type=Path)
    args = p.parse_args(argv)
    print(markdown(json.loads(args.json.read_text(encoding="utf-8"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
