"""The bf16 tile kernel (`amdllm.native.tiles_times`: AMX, or VDPBF16PS) against XLA:CPU's bf16 dots and
PyTorch's bf16 matmuls, on the products of a Llama-3.2-1B LoRA step at 256 rows.

Each product is x [rows, K] (bf16) times a frozen bf16 W, float32 sums:
  kn   W [K, N]   the forward of an [in, out] projection; the backward of the tied head (K = a vocabulary block)
  nk   W [N, K]   the backward of an [in, out] projection (dy . W^T); the tied head's forward block
PyTorch multiplies the same layouts (`x @ w` for kn, `F.linear(x, w)` for nk, as peft's nn.Linear).

The JAX sides (kernel and XLA, alternating per product) run in one process, PyTorch in another; each
product is timed as the median of --repeats batches of 5 calls, after a warm-up. Prints a table and, with
--out, writes bench_tiles.json there. Where no tile kernel runs (neither AMX nor AVX-512 BF16), its column
is empty.

    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/bench_tiles.py [--rows 256] [--repeats 7] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_json  # noqa: E402

# (name, K, N, layout): the 1B shape's products (hidden 2048, kv 512, intermediate 8192, vocabulary
# 128256 in 15 blocks of 8550)
PRODUCTS = [("q, o forward", 2048, 2048, "kn"), ("q, o backward", 2048, 2048, "nk"),
            ("k, v forward", 2048, 512, "kn"), ("k, v backward", 2048, 512, "nk"),
            ("gate, up forward", 2048, 8192, "kn"), ("gate, up backward", 8192, 2048, "nk"),
            ("down forward", 8192, 2048, "kn"), ("down backward", 2048, 8192, "nk"),
            ("head block forward", 2048, 8550, "nk"), ("head block backward", 8550, 2048, "kn")]


def timed(f, repeats: int) -> float:
    """Median seconds per call of f() (which blocks), over `repeats` batches of 5 calls, after one warm-up."""
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(5):
            f()
        times.append((time.perf_counter() - t) / 5)
    return sorted(times)[len(times) // 2]


def jax_side(rows: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from amdllm import native
    kind = native.tiles_kind()
    rng = np.random.default_rng(0)
    out = {"tiles_kind": kind, "ms": {}}
    for name, K, N, layout in PRODUCTS:
        nk = layout == "nk"
        x = jnp.asarray(rng.standard_normal((rows, K)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((N, K) if nk else (K, N)), jnp.bfloat16)
        bits = jax.lax.bitcast_convert_type(w, jnp.uint16)
        xla = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1 if nk else 0,)), ((), ())),
                                                       preferred_element_type=jnp.float32))
        row = {"xla": timed(lambda: xla(x, w).block_until_ready(), repeats) * 1e3}
        if kind is not None:
            tiles = jax.jit(lambda x, b: native.tiles_times(x, b, nk))
            got, want = tiles(x, bits), xla(x, w)
            row["max_rel_diff"] = float(jnp.abs(got - want).max() / jnp.abs(want).max())
            row["tiles"] = timed(lambda: tiles(x, bits).block_until_ready(), repeats) * 1e3
        out["ms"][name] = row
    return out


def torch_side(rows: int, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    out = {"threads": torch.get_num_threads(), "ms": {}}
    with torch.no_grad():
        for name, K, N, layout in PRODUCTS:
            x = torch.randn(rows, K).bfloat16()
            if layout == "nk":
                w = torch.randn(N, K).bfloat16()
                out["ms"][name] = timed(lambda: F.linear(x, w), repeats) * 1e3
            else:
                w = torch.randn(K, N).bfloat16()
                out["ms"][name] = timed(lambda: x @ w, repeats) * 1e3
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None, help="directory for bench_tiles.json")
    p.add_argument("--side", choices=["jax", "torch"], default=None, help=argparse.SUPPRESS)  # a child
    a = p.parse_args(argv)
    if a.side:
        print(json.dumps((jax_side if a.side == "jax" else torch_side)(a.rows, a.repeats)))
        return 0
    child = [sys.executable, str(Path(__file__).resolve()), "--rows", str(a.rows), "--repeats", str(a.repeats)]
    sides = {}
    for side in ("jax", "torch"):
        r = subprocess.run(child + ["--side", side], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"bench_tiles: the {side} side failed: {r.stderr.strip()[-500:]}", file=sys.stderr)
            return 1
        sides[side] = json.loads(r.stdout.strip().splitlines()[-1])
    kind = sides["jax"]["tiles_kind"]
    cols = ["product", f"tile kernel ({kind})", "XLA bf16 dot", "PyTorch bf16"]
    rows, total = [], {"tiles": 0.0, "xla": 0.0, "torch": 0.0}

    def rate(ms, K, N):
        return f"{ms:.2f} ({2 * a.rows * K * N / ms / 1e6:.0f})"
    for name, K, N, layout in PRODUCTS:
        j, t = sides["jax"]["ms"][name], sides["torch"]["ms"][name]
        total["xla"] += j["xla"]
        total["torch"] += t
        total["tiles"] += j.get("tiles", 0.0)
        rows.append(dict(zip(cols, [f"{name} {layout} K={K} N={N}", rate(j["tiles"], K, N) if "tiles" in j else "-",
                                    rate(j["xla"], K, N), rate(t, K, N)])))
    rows.append(dict(zip(cols, ["all ten", f"{total['tiles']:.1f}" if kind else "-", f"{total['xla']:.1f}",
                                f"{total['torch']:.1f}"])))
    print(f"{a.rows} rows, ms per product (GFLOP/s); tile kernel here: {kind}")
    print(table(rows, cols))
    write_json({"rows": a.rows, "repeats": a.repeats, "sides": sides, "total_ms": total}, a.out, "bench_tiles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
