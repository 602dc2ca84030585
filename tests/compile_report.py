"""What the GPU kernels cost in registers, spills and shared memory, without a GPU.

Every Triton kernel variant the backend launches is compiled for sm_80 and sm_90 (Triton's compiler
and its bundled ptxas), and every CUDA kernel the cuda backend launches is compiled for both by NVRTC,
as users' first call compiles it (``ktae_kernels.backends.cuda.runtime.compile_report``); ``ptxas -v``
reports each kernel's registers, spill stores and loads, and static shared memory. The Triton kernels' TTGIR is
also scanned for atomics whose result a kernel uses in a layout that replicates tensor elements over
threads (before Triton 3.5 only one replica received the result, triton-lang/triton#7402).

    python tests/compile_report.py [--out report.json]     # (TRITON_INTERPRET must be unset)

tests/test_triton_compile.py and tests/test_cuda_compile.py run it and hold the numbers to their rules.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = (80, 90)
#: opt-in dynamic shared memory per block (bytes): A100 (sm_80) and H100 / H200 (sm_90)
OPT_IN_SHARED = {80: 166912, 90: 232448}


def ptxas_report(log: str) -> dict[str, dict[str, int]]:
    """Per kernel entry of a ``ptxas -v`` log: registers, spill stores / loads (bytes), static shared
    memory (bytes). A device function's own properties (a non-inlined call) are not its caller's."""
    out: dict[str, dict[str, int]] = {}
    entry = properties = None
    for line in log.splitlines():
        if found := re.search(r"Compiling entry function '(\S+)'", line):
            entry = found.group(1)
            out[entry] = dict(registers=0, spill_stores=0, spill_loads=0, shared=0)
        elif found := re.search(r"Function properties for (\S+)", line):
            properties = found.group(1)
        elif (found := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)) and properties == entry:
            out[entry].update(spill_stores=int(found.group(1)), spill_loads=int(found.group(2)))
        elif (found := re.search(r"Used (\d+) registers", line)) and entry is not None:
            smem = re.search(r"(\d+) bytes smem", line)
            out[entry].update(registers=int(found.group(1)), shared=int(smem.group(1)) if smem else 0)
    return out


# ------------------------------------------------------------------------------ Triton
def triton_variants() -> list[tuple[object, dict, dict]]:
    """(kernel, signature, constexprs) of every variant the Triton backend launches: each kernel of
    ``pipeline`` and ``statistics``, its constexprs over the values the host passes (tiles: one
    rollout's 1024 positions, or 64 rollouts of 16)."""
    from ktae_kernels.backends.triton import pipeline as p, statistics as s

    def ptr(t):
        return "*" + t

    grp = dict(grp_ptr=ptr("i64"), n="i32")
    tiles = [(1, 1024), (64, 16)]
    return [
        *[(p.KERNELS["ranks"], dict(group_ptr=ptr("i64"), rewards_ptr=ptr("fp64"), correct_ptr=ptr("u8"),
                                 const_ptr=ptr("fp64"), B="i32", n="i32", grp_ptr=ptr("i64"), tab_ptr=ptr("i32"),
                                 roll_at="i64"), dict(HAS_CORRECT=c, BLOCK=1024)) for c in (True, False)],
        *[(p.KERNELS["lengths"], dict(mask_ptr=ptr("u8"), B="i32", L="i32", group_ptr=ptr("i64"), n="i32",
                                   grp_ptr=ptr("i64"), tab_ptr=ptr("i32"), roll_at="i64"), dict(ROWS=r, COLS=c))
          for r, c in tiles],
        *[(p.KERNELS["plan"], dict(**grp, slot_limit="i64", word_limit="i64", group_limit="i64", token_limit="i32",
                                guess="fp32", distinct_log_cap="i32"),
           dict(SAFE=safe, MIN_LOG_CAP=4, MAX_FIRST_LOG_CAP=16, MAX_LOG_CAP=40, BLOCK=1024)) for safe in (False, True)],
        (p.KERNELS["rebuild_plan"], dict(**grp, slot_limit="i64", word_limit="i64"),
         dict(MIN_LOG_CAP=4, MAX_LOG_CAP=40, BLOCK=1024)),
        *[(p.KERNELS["clear"], dict(**grp, tab_ptr=ptr("i32"), occ_ptr=ptr("i64"), bits_at="i64", group_ptr=ptr("i64"),
                                 rewards_ptr=ptr("fp64"), B="i32"), dict(GRPO=g, BLOCK=1024)) for g in (True, False)],
        *[(p.KERNELS["insert"], dict(resp_ptr=ptr("i64"), mask_ptr=ptr("u8"), B="i32", L="i32", group_ptr=ptr("i64"),
                                  **grp, tab_ptr=ptr("i32"), occ_ptr=ptr("i64"), roll_at="i64", order_at="i64",
                                  bits_at="i64", index_at="i64", probe_limit="i32"),
           dict(ROWS=r, COLS=c, PREDICATED=True, REBUILD=rebuild)) for (r, c), rebuild in itertools.product(tiles, (0, 1))],
        *[(p.KERNELS["score"], dict(**grp, tab_ptr=ptr("i32"), occ_ptr=ptr("i64"), order_at="i64", bits_at="i64",
                                 values_ptr=ptr("fp64"), grid_size="i32", const_ptr=ptr("fp64"), n_ignore="i32",
                                 lf_ptr=ptr("fp64"), angle_ptr=ptr("fp64"), stat_const_ptr=ptr("fp64")),
           dict(USE_TF=tf, INLINE=inline, BY_ROW=by_row, BLOCK=128))
          for tf, (inline, by_row) in itertools.product((True, False), ((False, False), (True, False), (False, True)))],
        (p.KERNELS["rows"], dict(**grp, tab_ptr=ptr("i32"), occ_ptr=ptr("i64"), order_at="i64", bits_at="i64",
                              row_start_ptr=ptr("i64"), out_ptr=ptr("i64"), n_rows="i32"), dict(BLOCK=128)),
        *[(p.KERNELS["advantage"], dict(B="i32", L="i32", group_ptr=ptr("i64"), rewards_ptr=ptr("fp64"),
                                     given_ptr=ptr("fp64"), **grp, tab_ptr=ptr("i32"), occ_ptr=ptr("i64"),
                                     roll_at="i64", index_at="i64", const_ptr=ptr("fp64"), out_ptr=ptr("fp32")),
           dict(BASELINE=b, REPORT=report, ROWS=r, COLS=c))
          for b, report, (r, c) in itertools.product(range(4), (False, True), tiles)],
        (s.KERNELS["statistics"], dict(cells_ptr=ptr("i32"), size="i32", lf_ptr=ptr("fp64"), angle_ptr=ptr("fp64"),
                                    const_ptr=ptr("fp64"), out_ptr=ptr("fp64")), dict(BLOCK=128)),
    ]


#: kernels launched with ``enable_fp_fusion=False`` (one rounding per float64 operation, as on the CPU)
UNFUSED = ("_statistics_kernel", "_score_kernel", "_advantage_kernel")


def _ptxas() -> str | None:
    """The newest ptxas Triton bundles (it reads the PTX version Triton emits), else the toolkit's."""
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    found = [os.path.join(bundled, name) for name in ("ptxas-blackwell", "ptxas")
             if os.path.exists(os.path.join(bundled, name))]
    return found[0] if found else shutil.which("ptxas")


def triton_report() -> dict:
    """Per arch, per variant ("kernel{constexprs}"): ptxas's registers, spills and static shared memory,
    Triton's dynamic shared memory, the float64 fma left, and the replicated atomic results the TTGIR
    shows (none allowed; ``checker_catches_7402``: the scan flags the pattern #7402 breaks)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = _ptxas()
    report: dict = {f"sm_{arch}": {} for arch in ARCHS}
    broken = triton.compile(ASTSource(fn=_row_atomic_broadcast(), signature=dict(fill_ptr="*i32", out_ptr="*i32"),
                                      constexprs=dict(ROWS=1, COLS=1024)), target=GPUTarget("cuda", 90, 32))
    report["checker_catches_7402"] = bool(replicated_atomics(broken.asm["ttgir"]))
    with tempfile.TemporaryDirectory() as tmp:
        for arch, (kernel, signature, constants) in itertools.product(ARCHS, triton_variants()):
            options = dict(enable_fp_fusion=False) if kernel.__name__ in UNFUSED else {}
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                                      target=GPUTarget("cuda", arch, 32), options=options or None)
            name = f"{kernel.__name__}{json.dumps(constants, sort_keys=True)}"
            entry = dict(replicated_atomics=replicated_atomics(compiled.asm["ttgir"]),
                         fma_f64=compiled.asm["ptx"].count("fma.rn.f64"), dynamic_shared=compiled.metadata.shared)
            if ptxas is not None:
                ptx = Path(tmp) / "k.ptx"
                ptx.write_text(compiled.asm["ptx"])
                target = re.search(r"^\.target (\w+)", compiled.asm["ptx"], re.M).group(1)  # sm_90a on Hopper
                done = subprocess.run([ptxas, "-v", f"-arch={target}", str(ptx), "-o", os.devnull],
                                      capture_output=True, text=True)
                entry.update(next(iter(ptxas_report(done.stdout + done.stderr).values()), {}))
            report[f"sm_{arch}"][name] = entry
    return report


def _row_atomic_broadcast():
    """The pattern #7402 breaks: one atomic per row, its result used by every lane of the row."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(fill_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
        row = tl.arange(0, ROWS)[:, None]
        col = tl.arange(0, COLS)[None, :]
        first = tl.atomic_add(fill_ptr + row, 1, sem="relaxed")
        tl.store(out_ptr + first * COLS + col, 1)

    return kernel


def layouts(ttgir: str) -> dict[str, tuple]:
    """``#name -> (sizePerThread, threadsPerWarp, warpsPerCTA)`` of the blocked layouts."""
    out = {}
    for name, body in re.findall(r"^(#\w+) = #ttg\.blocked<\{(.*)\}>", ttgir, re.M):
        fields = dict((k, [int(v) for v in vals.split(",")])
                      for k, vals in re.findall(r"(\w+) = \[([\d, ]+)\]", body))
        out[name] = (fields["sizePerThread"], fields["threadsPerWarp"], fields["warpsPerCTA"])
    return out


def replicated_atomics(ttgir: str) -> list[str]:
    """Atomics (and non-pure inline asm) whose per-lane result may be wrong before Triton 3.5: a used
    result of a scalar, of a non-blocked layout, or of a layout that holds an element in more than one
    thread. Returns descriptions (empty: safe on every Triton)."""
    blocked = layouts(ttgir)
    lines = ttgir.splitlines()
    bad = []
    for i, line in enumerate(lines):
        op = re.search(r"(tt\.atomic_rmw|tt\.atomic_cas|tt\.elementwise_inline_asm)", line)
        if not op:
            continue
        side_effect = op.group(1) == "tt.elementwise_inline_asm"
        if side_effect and "pure = false" not in line:
            continue
        result = re.match(r"\s*(%[\w.]+)(?::\d+)? = ", line)
        used = result is not None and _used_after(result.group(1), lines[i + 1:])
        if not (used or side_effect):
            continue
        types = re.findall(r"tensor<([\dx]+)x[^,>]*, (#\w+)>", line.split("->")[-1] if "->" in line else line)
        if not types:
            bad.append(f"scalar result: {line.strip()[:160]}")
            continue
        dims, layout = types[-1]
        shape = [int(d) for d in dims.split("x")]
        if layout not in blocked:
            bad.append(f"layout {layout} not checked: {line.strip()[:160]}")
            continue
        spt, tpw, wpc = blocked[layout]
        if any(s * t * w > n for s, t, w, n in zip(spt, tpw, wpc, shape)):
            bad.append(f"replicated {shape} in {layout}={blocked[layout]}: {line.strip()[:160]}")
    return bad


def _used_after(name: str, lines: list[str]) -> bool:
    """Whether SSA value ``name`` is used in ``lines`` before a line defines that name again (the printed
    IR reuses names in other regions)."""
    pattern = re.compile(re.escape(name) + r"(?![\w.])")
    for line in lines:
        if re.match(r"\s*" + re.escape(name) + r"(?::\d+)? = ", line):
            return False
        if pattern.search(line):
            return True
    return False


# ------------------------------------------------------------------------------ CUDA
def cuobjdump() -> str | None:
    """A cuobjdump (CUDA's, or the one in Triton's wheel), for the SASS of the cubins; None without one."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else None


def sass(code: bytes) -> str:
    """The SASS of a cubin (cuobjdump -sass)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(code)
        f.flush()
        done = subprocess.run([cuobjdump(), "-sass", f.name], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-4000:])
    return done.stdout


def cuda_report() -> dict:
    """Per arch, per kernel of the cuda backend (``runtime.KERNELS``, by readable name): ptxas's
    registers, spills, shared memory, from NVRTC's compile of the device source; on sm_90 (with cuobjdump)
    the order of its token-id loads and range checks (``id_loads_and_checks``)."""
    from ktae_kernels.backends.cuda import runtime

    report = {}
    for arch in ARCHS:
        _, log = runtime.compile_report(arch)
        report[f"sm_{arch}"] = {_demangled(name): entry for name, entry in ptxas_report(log).items()}
    if cuobjdump() is not None:
        for name, code in sass_functions(sass(runtime.cubin(90).code)).items():
            report["sm_90"][name]["id_loads_and_checks"] = id_loads_and_checks(code)
    return report


def sass_functions(sass: str) -> dict[str, str]:
    """``cuobjdump -sass`` output split per kernel entry (demangled name -> its instructions)."""
    out: dict[str, list[str]] = {}
    lines = None
    for line in sass.splitlines():
        if found := re.search(r"Function : (\S+)", line):
            lines = out.setdefault(_demangled(found.group(1)), [])
        elif lines is not None:
            lines.append(line)
    return {name: "\n".join(body) for name, body in out.items()}


#: the range check of a token id, id < 0 || id > 2^31 - 1, as one unsigned 64-bit compare (its low half)
_ID_CHECK = re.compile(r"ISETP\.GE\.U32\.AND P\d, PT, (R\d+), -0x80000000, PT")
_LOAD64 = re.compile(r"LDG\.E\.64(?:\.\w+)* (R\d+), ")


def id_loads_and_checks(sass: str) -> str:
    """The order of a kernel's token-id loads and their range checks: "L" for a 64-bit global load whose
    register a range check tests next (before another load writes it), "C" for a range check, in
    instruction order. A tile whose loads all issue before any check reads ``"LLLLCCCC"`` (kUnroll 4);
    a check between two loads (``"LCLC..."``) makes each load wait for the one before."""
    events = []
    for line in sass.splitlines():
        if found := _ID_CHECK.search(line):
            events.append(("C", found.group(1)))
        elif found := _LOAD64.search(line):
            events.append(("L", found.group(1)))
    order = []
    for i, (kind, register) in enumerate(events):
        if kind == "C":
            order.append("C")
            continue
        following = next((k for k, r in events[i + 1:] if r == register), None)
        if following == "C":
            order.append("L")
    return "".join(order)


def _demangled(name: str) -> str:
    """A readable kernel name: ``dynamic_kernel<true>`` for ``_ZN4ktae..14dynamic_kernelILb1EEEvNS_10KernelArgsE``."""
    found = re.search(r"\d+([a-z_]+_kernel)(?=I|E)", name)
    if not found:
        return name
    args = re.findall(r"L([ib])(\d+)E", name[found.end():].split("EEv")[0] + "E")
    values = [("true" if v == "1" else "false") if t == "b" else v for t, v in args]
    return found.group(1) + (f"<{', '.join(values)}>" if values else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--only", choices=("triton", "cuda"), help="one family only")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET must be unset: the kernels are compiled, not interpreted")
    report = {}
    if args.only in (None, "triton"):
        report["triton"] = triton_report()
    if args.only in (None, "cuda"):
        report["cuda"] = cuda_report()
    text = json.dumps(report, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the package, when run as a script from the clone
    sys.exit(main())
