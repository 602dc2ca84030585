"""Every Triton kernel compiles to an sm_90 (H100/H200) cubin, without a GPU.

The interpreter tests check what the kernels compute; this checks that the same source passes
Triton's GPU compiler and ptxas (loop-carried types, constexpr globals, the predicated inline PTX of
the CUDA-only compare-and-swap). It runs in a subprocess because TRITON_INTERPRET must be unset there.

It also checks, in the compiled TTGIR, that no atomic (or side-effecting inline PTX) whose result a
kernel uses has a layout that replicates tensor elements over threads: before Triton 3.5 only one of
the replicas receives the atomic's result, the others read 0 (triton-lang/triton#7402, fixed by
#7460), and the interpreter cannot show it. A kernel with the pattern once used in
``tables._insert_kernel`` (one atomic per tile row, its result broadcast over the row) must be flagged.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = r'''
import itertools, os, re, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
    print("NO_PTXAS"); sys.exit(0)
from ktae_kernels.backends.triton import advantage, scores, statistics, tables

def ptr(t):
    return "*" + t

TOKENS = dict(resp_ptr=ptr("i64"), mask_ptr=ptr("u8"), B="i32", L="i32", group_ptr=ptr("i64"))
TABLE = dict(keys_ptr=ptr("i32"), occ_ptr=ptr("i64"), bits_ptr=ptr("i32"), correct_bits_ptr=ptr("i32"), words="i32")
KERNELS = [
    (tables._insert_kernel,
     dict(**TOKENS, rank_ptr=ptr("i32"), inc_ptr=ptr("i64"), keys_ptr=ptr("i32"), occ_ptr=ptr("i64"),
          bits_ptr=ptr("i32"), words="i32", order_ptr=ptr("i32"), offset_ptr=ptr("i64"), log_cap_ptr=ptr("i32"),
          fill_ptr=ptr("i32"), overflow_ptr=ptr("i32"), probe_limit="i32", bad_ptr=ptr("i64"),
          row_map_ptr=ptr("i64")),
     [dict(ROWS=r, COLS=c, PREDICATED=p, MAPPED=m)
      for (r, c), p, m in itertools.product([(1, 1024), (64, 16)], [True, False], [False, True])]),
    (tables._flatten_kernel,
     dict(order_ptr=ptr("i32"), offset_ptr=ptr("i64"), fill_ptr=ptr("i32"), row_start_ptr=ptr("i64"),
          slot_ptr=ptr("i64"), group_ptr=ptr("i32")), [dict(BLOCK=2048)]),
    (tables._row_counts_kernel,
     dict(slot_ptr=ptr("i64"), group_ptr=ptr("i32"), n_rows="i32", **TABLE, token_ptr=ptr("i64"),
          a_ptr=ptr("i64"), b_ptr=ptr("i64"), f_c_ptr=ptr("i64"), f_w_ptr=ptr("i64")), [dict(BLOCK=256)]),
    (scores._score_kernel,
     dict(slot_ptr=ptr("i64"), group_ptr=ptr("i32"), n_rows="i32", **TABLE, n_c_ptr=ptr("i64"),
          n_w_ptr=ptr("i64"), T_c_ptr=ptr("i64"), T_w_ptr=ptr("i64"), index_ptr=ptr("i64"), n_groups="i32",
          values_ptr=ptr("fp64"), grid_size="i32", const_ptr=ptr("fp64"), n_ignore="i32",
          slot_score_ptr=ptr("fp64"), p_ptr=ptr("fp64"), F_ptr=ptr("fp64"), IG_ptr=ptr("fp64"), x_ptr=ptr("fp64"),
          score_ptr=ptr("fp64")),
     [dict(USE_TF=u, WRITE_ROWS=w, BLOCK=128) for u, w in itertools.product([True, False], repeat=2)]),
    (advantage._advantage_kernel,
     dict(**TOKENS, base_ptr=ptr("fp64"), const_ptr=ptr("fp64"), keys_ptr=ptr("i32"), offset_ptr=ptr("i64"),
          log_cap_ptr=ptr("i32"), slot_score_ptr=ptr("fp64"), out_ptr=ptr("fp32")),
     [dict(ROWS=1, COLS=1024), dict(ROWS=64, COLS=16)]),
]

# the sync-free path (nosync.py)
from ktae_kernels.backends.triton import nosync
GRP = dict(grp_ptr=ptr("i64"), n="i32")
KERNELS += [
    (nosync._ranks_kernel,
     dict(group_ptr=ptr("i64"), rewards_ptr=ptr("fp64"), correct_ptr=ptr("u8"), const_ptr=ptr("fp64"), B="i32",
          n="i32", grp_ptr=ptr("i64"), tab_ptr=ptr("i32"), roll_at="i64"),
     [dict(HAS_CORRECT=c, BLOCK=1024) for c in (True, False)]),
    (nosync._lengths_kernel,
     dict(mask_ptr=ptr("u8"), B="i32", L="i32", group_ptr=ptr("i64"), n="i32", grp_ptr=ptr("i64"),
          tab_ptr=ptr("i32"), roll_at="i64"), [dict(ROWS=1, COLS=1024), dict(ROWS=64, COLS=16)]),
    (nosync._plan_kernel,
     dict(**GRP, slot_limit="i64", word_limit="i64", group_limit="i32", token_limit="i32", guess="fp32",
          distinct_log_cap="i32"),
     [dict(MIN_LOG_CAP=4, MAX_LOG_CAP=16, BLOCK=1024)]),
    (nosync._rebuild_plan_kernel, dict(**GRP, slot_limit="i64", word_limit="i64"), [dict(BLOCK=1024)]),
    (nosync._clear_kernel,
     dict(**GRP, tab_ptr=ptr("i32"), occ_ptr=ptr("i64"), bits_at="i64", group_ptr=ptr("i64"), rewards_ptr=ptr("fp64"),
          B="i32"), [dict(GRPO=g, BLOCK=1024) for g in (True, False)]),
    (nosync._insert_kernel,
     dict(resp_ptr=ptr("i64"), mask_ptr=ptr("u8"), B="i32", L="i32", group_ptr=ptr("i64"), **GRP,
          tab_ptr=ptr("i32"), occ_ptr=ptr("i64"), roll_at="i64", order_at="i64", bits_at="i64", index_at="i64",
          probe_limit="i32"),
     [dict(ROWS=r, COLS=c, PREDICATED=p, REBUILD=m)
      for (r, c), p, m in itertools.product([(1, 1024), (64, 16)], [True, False], [False, True])]),
    (nosync._score_kernel,
     dict(**GRP, tab_ptr=ptr("i32"), occ_ptr=ptr("i64"), order_at="i64", bits_at="i64", values_ptr=ptr("fp64"),
          grid_size="i32", const_ptr=ptr("fp64"), n_ignore="i32", lf_ptr=ptr("fp64"), angle_ptr=ptr("fp64"),
          stat_const_ptr=ptr("fp64")),
     [dict(USE_TF=u, INLINE=i, BLOCK=128) for u in (True, False) for i in (False, True)]),
    (nosync._advantage_kernel,
     dict(B="i32", L="i32", group_ptr=ptr("i64"), rewards_ptr=ptr("fp64"), given_ptr=ptr("fp64"), **GRP,
          tab_ptr=ptr("i32"), occ_ptr=ptr("i64"), roll_at="i64", index_at="i64", const_ptr=ptr("fp64"),
          out_ptr=ptr("fp32")),
     [dict(BASELINE=b, ROWS=1, COLS=1024) for b in range(4)] + [dict(BASELINE=3, ROWS=64, COLS=16)]),
]


def layouts(ttgir):
    """``#name -> (sizePerThread, threadsPerWarp, warpsPerCTA)`` of the blocked layouts."""
    out = {}
    for name, body in re.findall(r"^(#\w+) = #ttg\.blocked<\{(.*)\}>", ttgir, re.M):
        fields = dict((k, [int(v) for v in vals.split(",")])
                      for k, vals in re.findall(r"(\w+) = \[([\d, ]+)\]", body))
        out[name] = (fields["sizePerThread"], fields["threadsPerWarp"], fields["warpsPerCTA"])
    return out


def replicated_atomics(ttgir):
    """Atomics (and non-pure inline asm) whose per-lane result may be wrong before Triton 3.5: a
    used result of a scalar, of a non-blocked layout, or of a layout that holds an element in more
    than one thread. Returns descriptions (empty: safe on every Triton)."""
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
        used = result is not None and any(re.search(re.escape(result.group(1)) + r"(?![\w.])", other)
                                          for j, other in enumerate(lines) if j != i)
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


@triton.jit
def _row_atomic_broadcast(fill_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The pattern #7402 breaks: one atomic per row, its result used by every lane of the row."""
    row = tl.arange(0, ROWS)[:, None]
    col = tl.arange(0, COLS)[None, :]
    first = tl.atomic_add(fill_ptr + row, 1, sem="relaxed")
    tl.store(out_ptr + first * COLS + col, 1)


def compile_sm90(kernel, signature, constants, **options):
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                          target=GPUTarget("cuda", 90, 32), options=options or None)


buggy = compile_sm90(_row_atomic_broadcast, dict(fill_ptr=ptr("i32"), out_ptr=ptr("i32")), dict(ROWS=1, COLS=1024))
assert replicated_atomics(buggy.asm["ttgir"]), "the checker misses the #7402 pattern"
print("flagged the #7402 pattern")
for kernel, signature, variants in KERNELS:
    for constants in variants:
        compiled = compile_sm90(kernel, signature, constants)
        assert compiled.asm["cubin"], (kernel.__name__, constants)
        bad = replicated_atomics(compiled.asm["ttgir"])
        assert not bad, (kernel.__name__, constants, bad)
        print("compiled", kernel.__name__, constants)

# the kernels that promise one rounding per float64 operation, as on the CPU, are launched with
# enable_fp_fusion=False: that removes every contraction of their own arithmetic (the fma left in
# the statistics and score kernels are libdevice's exp / log, which rely on fma; the advantage
# kernel calls none and keeps none)
STATS = dict(cells_ptr=ptr("i32"), size="i32", lf_ptr=ptr("fp64"), angle_ptr=ptr("fp64"), const_ptr=ptr("fp64"),
             out_ptr=ptr("fp64"))
UNFUSED = [(statistics._statistics_kernel, STATS, dict(BLOCK=128), None),
           (KERNELS[3][0], KERNELS[3][1], KERNELS[3][2][0], None),
           (KERNELS[4][0], KERNELS[4][1], KERNELS[4][2][0], 0)]
for kernel, signature, constants, left in UNFUSED:
    fused = compile_sm90(kernel, signature, constants).asm["ptx"].count("fma.rn.f64")
    unfused = compile_sm90(kernel, signature, constants, enable_fp_fusion=False).asm["ptx"].count("fma.rn.f64")
    assert unfused < fused and (left is None or unfused == left), (kernel.__name__, fused, unfused)
    print("unfused", kernel.__name__, fused, "->", unfused)
'''


def test_kernels_compile_for_sm90_and_use_no_replicated_atomic_result(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    script = tmp_path / "compile_sm90.py"  # a file: triton.jit reads the kernel's source
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    if "NO_PTXAS" in done.stdout:
        pytest.skip("this triton wheel has no bundled ptxas")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "flagged the #7402 pattern" in done.stdout
    assert done.stdout.count("compiled") == 8 + 1 + 1 + 4 + 2 + (2 + 2 + 1 + 1 + 2 + 8 + 4 + 5)
    assert done.stdout.count("unfused") == 3
