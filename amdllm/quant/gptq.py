"""GPTQ in JAX: the quantizer grid, the solver and RTN (the command is `amdllm.cli.quantize`).

The solver follows the reference (IST-DASLab `gptq.py::fasterquant`; lesson 04 walks through it) with
weights [out N, in K]: dead columns, relative dampening, the upper Cholesky factor of H^-1, blocks of 128
columns with a lazy batch update, groups, act-order with `g_idx`, static groups, and GPTQModel's
group-aware order (its default and ours). Scales are rounded to fp16 when chosen, so the error feedback
sees the weights the checkpoint holds. The factor runs on the host with a CPU back end, on the device
otherwise; the rest is one compiled function per weight shape (`_gptq_core`)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from amdllm.model.quantized import pack_cols, pack_rows
from amdllm.quant.hessian import GPTQError, hessian_inverse, mean_diagonal  # noqa: F401 (re-exported)

SOLVER_BITS = (2, 3, 4, 8)
GROUP_SIZES = (-1, 16, 32, 64, 128, 256, 512, 1024)  # GPTQModel's allowed values
SUB_BLOCK = 32  # rows of `_solve_block`'s rank-1 steps
MSE_GRID, MSE_MAXSHRINK, MSE_NORM = 100, 0.8, 2.4  # the reference's search: shrinks 1 - i / 100, i < 80


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    act_order: bool = False      # desc_act
    static_groups: bool = False
    act_group_aware: bool = True  # GPTQModel's GAR: act-order within and between groups, g_idx stays k // G
    percdamp: float = 0.01
    blocksize: int = 128
    true_sequential: bool = True
    mse: bool = False             # search each grid's range for the least rounding error (`find_params`)

    def __post_init__(self):
        if self.bits not in SOLVER_BITS:
            raise GPTQError(f"bits={self.bits} is not supported; expected one of {SOLVER_BITS}")
        if self.group_size not in GROUP_SIZES:
            raise GPTQError(f"group_size={self.group_size} is not supported; expected one of {GROUP_SIZES}")
        if not 0 < self.percdamp < 1:
            raise GPTQError(f"percdamp={self.percdamp} must be in (0, 1)")

    @property
    def maxq(self) -> int:
        return 2 ** self.bits - 1

    def groups(self, K: int, where: str = "weight") -> int:
        """Group length for K input features (G=-1 -> K), checked to divide K."""
        if self.group_size == -1:
            return K
        if K % self.group_size:
            raise GPTQError(f"{where}: group_size {self.group_size} does not divide in_features {K}")
        return self.group_size


def in_features(cfg) -> list[int]:
    """The distinct input sizes of a Llama layer's projections (hidden for q/k/v/gate/up, the attention
    width for o, the MLP width for down): a group size must divide each of them."""
    return sorted({cfg.hidden_size, cfg.q_dim, cfg.intermediate_size})


def fit_group_size(cfg, group_size: int) -> tuple[int, str | None]:
    """(group size to use, note): `group_size` itself when it divides every projection's in_features,
    else the largest size GPTQModel allows (GROUP_SIZES) that divides them all, else -1 (one group per
    output row). The note says what changed and why; None when nothing did."""
    ks = in_features(cfg)
    if group_size == -1 or all(k % group_size == 0 for k in ks):
        return group_size, None
    fits = [g for g in GROUP_SIZES if g != -1 and g <= group_size and all(k % g == 0 for k in ks)]
    chosen = max(fits) if fits else -1
    how = f"{chosen}, the largest allowed size that divides them all" if fits else "-1 (one group per output row)"
    return chosen, (f"group_size {group_size} does not divide the projections' in_features {ks}; "
                    f"using {how}")


def check_group_size(cfg, group_size: int, where: str) -> None:
    """What `quantize` accepts, for every command that plans or runs it: a size GPTQModel allows that
    divides every projection's in_features (`where` names the model in the error)."""
    if group_size not in GROUP_SIZES:
        raise GPTQError(f"--group-size {group_size} is not supported; expected one of {GROUP_SIZES}")
    fitted, note = fit_group_size(cfg, group_size)
    if note:
        raise GPTQError(f"--group-size {group_size} does not divide the in_features {in_features(cfg)} of "
                        f"{where}'s projections; pass --group-size {fitted}"
                        + (" (one group per output row)" if fitted == -1 else " (the largest that fits)"))


@dataclass
class QuantResult:
    """One linear, reference orientation: Q and codes [N, K]; scales/zeros [n_g, N]; g_idx [K]."""
    Q: np.ndarray
    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    g_idx: np.ndarray
    damp: float = 0.0
    err: float | None = None  # GPTQ: tr((W-Q) H (W-Q)^T) for the H given (`reconstruction_error` for that H)

    def packed(self, bits: int) -> dict:
        """The dict a QuantLinear holds (per layer; v2 zeros), kernels [in, out]."""
        return {"qweight": pack_rows(self.codes.T, bits), "qzeros": pack_cols(self.zeros, bits),
                "scales": self.scales.astype(np.float16), "g_idx": self.g_idx.astype(np.int32)}


# --------------------------------------------------------------------------------------------------
# The grid (GPTQ's quantizer): unsigned codes 0..maxq in both modes, zero = 2^(b-1) when symmetric
# --------------------------------------------------------------------------------------------------
def _range(x, sym: bool):
    """Per-row (xmin, xmax) of x [N, n], widened to hold 0; mirrored when symmetric; (-1, 1) for a zero row."""
    xmin = jnp.minimum(x.min(axis=1), 0.0)
    xmax = jnp.maximum(x.max(axis=1), 0.0)
    if sym:
        xmax = jnp.maximum(jnp.abs(xmin), xmax)
        xmin = jnp.where(xmin < 0, -xmax, xmin)  # reference: a row without negatives keeps xmin = 0
    both0 = (xmin == 0) & (xmax == 0)
    return jnp.where(both0, -1.0, xmin), jnp.where(both0, 1.0, xmax)


def _grid(xmin, xmax, maxq: int, sym: bool, scale_dtype):
    """(scale, zero) of the grid spanning [xmin, xmax]."""
    scale = (xmax - xmin) / maxq
    if jnp.dtype(scale_dtype) != jnp.float32:  # the stored scale; floor at fp16's smallest normal
        scale = jnp.maximum(scale, 6.2e-5).astype(scale_dtype).astype(jnp.float32)
    zero = jnp.full_like(scale, (maxq + 1) // 2) if sym else jnp.round(-xmin / scale)
    return scale, zero


def find_params(x, maxq: int, sym: bool, scale_dtype=jnp.float16, mse: bool = False, colw=None):
    """x [N, n] -> per-row (scale [N], zero [N]) float32. The grid spans the row's range; with `mse`,
    the range shrunk by the factor (1, 0.99, ..., 0.21) whose grid rounds the row with the least
    sum |error|^2.4 (the reference quantizer's `mse` search: clipping a rare outlier can buy a finer
    grid for all the other weights), each column's error times `colw` [n] where given."""
    xmin, xmax = _range(x, sym)
    scale, zero = _grid(xmin, xmax, maxq, sym, scale_dtype)
    if not mse:
        return scale, zero

    def err(s, z):
        e = jnp.abs(fake_quant(x, s[:, None], z[:, None], maxq) - x) ** MSE_NORM
        return jnp.sum(e if colw is None else e * colw[None, :], axis=1)

    def body(i, c):
        best, s0, z0 = c
        p = 1.0 - i / MSE_GRID
        s1, z1 = _grid(p * xmin, p * xmax, maxq, sym, scale_dtype)
        e = err(s1, z1)
        better = e < best
        return jnp.where(better, e, best), jnp.where(better, s1, s0), jnp.where(better, z1, z0)

    _, scale, zero = jax.lax.fori_loop(1, int(MSE_MAXSHRINK * MSE_GRID), body, (err(scale, zero), scale, zero))
    return scale, zero


def quantize_codes(w, scale, zero, maxq: int):
    return jnp.clip(jnp.round(w / scale) + zero, 0, maxq)


def fake_quant(w, scale, zero, maxq: int):
    return scale * (quantize_codes(w, scale, zero, maxq) - zero)


# --------------------------------------------------------------------------------------------------
# RTN: the same grid, no error feedback
# --------------------------------------------------------------------------------------------------
@partial(jax.jit, static_argnames=("maxq", "sym", "G", "scale_dtype", "mse"))
def _rtn_core(W, *, maxq, sym, G, scale_dtype, mse=False):
    N, K = W.shape
    Wg = W.reshape(N, K // G, G).transpose(1, 0, 2)                     # [n_g, N, G]
    s, z = jax.vmap(lambda w: find_params(w, maxq, sym, scale_dtype, mse))(Wg)  # [n_g, N]
    g_idx = jnp.arange(K) // G
    codes = quantize_codes(W, s[g_idx].T, z[g_idx].T, maxq)
    return s[g_idx].T * (codes - z[g_idx].T), codes, s, z


def rtn_quantize(W, spec: QuantSpec, scale_dtype=jnp.float16) -> QuantResult:
    """W [N, K] -> QuantResult with groups of consecutive input columns."""
    W = jnp.asarray(W, jnp.float32)
    G = spec.groups(W.shape[1])
    Q, codes, s, z = _rtn_core(W, maxq=spec.maxq, sym=spec.sym, G=G, scale_dtype=jnp.dtype(scale_dtype).name,
                               mse=spec.mse)
    return QuantResult(np.asarray(Q), np.asarray(codes, np.int32), np.asarray(s), np.asarray(z, np.int32),
                       (np.arange(W.shape[1]) // G).astype(np.int32))


# --------------------------------------------------------------------------------------------------
# GPTQ
# --------------------------------------------------------------------------------------------------
def _solve_rows(W1, U1, cs, cz, *, maxq):
    """Columns one at a time, held as rows: W1 [b, N] (row i is column i of the reference's [N, b],
    so each step reads and writes contiguous rows); U1 [b, b] upper; cs/cz [b, N] each column's grid
    -> Q1, C1, E1 [b, N]."""

    def body(i, c):
        W1, Q1, C1, E1 = c
        w = jax.lax.dynamic_index_in_dim(W1, i, axis=0, keepdims=False)       # [N]
        s = jax.lax.dynamic_index_in_dim(cs, i, axis=0, keepdims=False)
        z = jax.lax.dynamic_index_in_dim(cz, i, axis=0, keepdims=False)
        code = quantize_codes(w, s, z, maxq)
        q = s * (code - z)
        e = (w - q) / U1[i, i]                                                # [N]
        W1 = W1 - U1[i][:, None] * e[None, :]  # U1 is upper triangular: rows < i are untouched
        upd = lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, i, axis=0)  # noqa: E731
        return W1, upd(Q1, q), upd(C1, code), upd(E1, e)

    zeros = jnp.zeros_like(W1)
    _, Q1, C1, E1 = jax.lax.fori_loop(0, W1.shape[0], body, (W1, zeros, zeros, zeros))
    return Q1, C1, E1


def _solve_block(W1, U1, cs, cz, *, maxq, sub=SUB_BLOCK):
    """One block of b columns as rows (W1 [b, N]), in sub-blocks of `sub` rows: each column's rank-1
    update reaches only the rest of its sub-block, and one GEMM per sub-block brings the block's later
    rows up to date (the lazy batch update again, one level down: the same arithmetic in a different
    order). The rank-1 steps, which touch a whole [rows, N] array each, were most of the solve."""
    b = W1.shape[0]
    sub = sub if b % sub == 0 else b
    outs = []
    for j0 in range(0, b, sub):
        j1 = j0 + sub
        Q, C, E = _solve_rows(W1[:sub], U1[j0:j1, j0:j1], cs[j0:j1], cz[j0:j1], maxq=maxq)
        W1 = W1[sub:] - U1[j0:j1, j1:].T @ E                                   # [b - j1, N]
        outs.append((Q, C, E))
    return tuple(jnp.concatenate(o) for o in zip(*outs))


@partial(jax.jit, static_argnames=("maxq", "sym", "G", "B", "static_groups", "scale_dtype", "mse"))
def _gptq_core(W, U, dead, perm, *, maxq, sym, G, B, static_groups, scale_dtype, mse=False):
    """The whole solve as ONE compiled function per (shape, settings): a Python loop over blocks
    here would cost an eager dispatch (and a compile per shape) for every slice and update.
    W [N, K] original order; U [K, K] for the permuted columns; dead [K] bool; perm [K] (identity
    without act-order). Returns Q, codes, per-column scale/zero, all [N, K] in the original order, and
    for the error (`gptq_quantize`) each block's sum of e^2 and ||W - Q||^2 (dead columns zeroed).
    Inside, the weights are held transposed ([K, N]): the solve walks the input columns one at a
    time, and as rows each one is contiguous (as [N, K] columns, each step's reads and five writes
    touched a cache line per output row, and took most of the time)."""
    N, K = W.shape
    fp = partial(find_params, maxq=maxq, sym=sym, scale_dtype=scale_dtype, mse=mse)
    W = jnp.where(dead[None, :], 0.0, W)
    # preset grids, from the ORIGINAL column order before any update: per row over all K (G=-1), or
    # static groups; otherwise each group's is computed during the solve (see `block`)
    # the grid search weighs column j's rounding error by 1 / U_jj^2.4: the solve charges e_j as
    # (e_j / U_jj)^2, so a column the later ones can barely correct counts for more (the reference
    # quantizer weighs all columns alike)
    dw, inv = jnp.diag(U) ** (-MSE_NORM), jnp.argsort(perm)                   # [K] for the permuted columns
    dw0 = dw[inv]                                                             # [K], original order
    if G == -1:
        s0, z0 = fp(W, colw=dw0)
        col_s, col_z = jnp.broadcast_to(s0[None, :], (K, N)), jnp.broadcast_to(z0[None, :], (K, N))
    elif static_groups:
        ss, zz = jax.vmap(lambda a, c: fp(a, colw=c))(W.reshape(N, K // G, G).transpose(1, 0, 2),
                                                      dw0.reshape(K // G, G))    # [n_g, N]
        col_s, col_z = ss[jnp.arange(K) // G], zz[jnp.arange(K) // G]
    else:
        col_s = col_z = jnp.ones((K, N), jnp.float32)
    preset = G == -1 or static_groups
    Wt, col_s, col_z = W.T[perm], col_s[perm], col_z[perm]                   # [K, N], permuted rows
    # pad to whole blocks: zero weights on an identity corner quantize to 0 and feed back nothing
    Kp = -(-K // B) * B
    if Kp != K:
        Wt = jnp.pad(Wt, ((0, Kp - K), (0, 0)))
        U = jnp.pad(U, ((0, Kp - K), (0, Kp - K))) + jnp.diag(jnp.arange(Kp) >= K).astype(U.dtype)
        col_s, col_z = (jnp.pad(a, ((0, Kp - K), (0, 0)), constant_values=1.0) for a in (col_s, col_z))
        dw = jnp.pad(dw, (0, Kp - K), constant_values=1.0)
    rows = jnp.arange(Kp)

    def block(carry, i1):
        Wt, s, z = carry
        W1 = jax.lax.dynamic_slice_in_dim(Wt, i1, B, axis=0)                  # [B, N]
        U1 = jax.lax.dynamic_slice(U, (i1, i1), (B, B))
        cs = jax.lax.dynamic_slice_in_dim(col_s, i1, B, axis=0)
        cz = jax.lax.dynamic_slice_in_dim(col_z, i1, B, axis=0)
        # a group's grid comes from its columns as they stand when its block starts: after the earlier
        # blocks' updates, before this block's own (the reference's rule, and GPTQModel's)
        if not preset and G >= B:  # a group spans whole blocks: chosen at its first, carried on
            s, z = jax.lax.cond(i1 % G == 0, lambda: fp(jax.lax.dynamic_slice_in_dim(Wt, i1, G, axis=0).T,
                                                         colw=jax.lax.dynamic_slice_in_dim(dw, i1, G)),
                                lambda: (s, z))
            cs, cz = jnp.broadcast_to(s[None, :], (B, N)), jnp.broadcast_to(z[None, :], (B, N))
        elif not preset:           # B // G groups in this block, each from the block's rows as they are now
            gs, gz = jax.vmap(lambda a, c: fp(a, colw=c))(W1.reshape(B // G, G, N).transpose(0, 2, 1),
                                                          jax.lax.dynamic_slice_in_dim(dw, i1, B).reshape(B // G, G))
            cs, cz = jnp.repeat(gs, G, axis=0), jnp.repeat(gz, G, axis=0)
        Q1, C1, E1 = _solve_block(W1, U1, cs, cz, maxq=maxq)
        S1, Z1 = cs, cz
        # lazy batch update of the rows below the block: one [Kp,B] @ [B,N] GEMM (the full height
        # keeps shapes static; U's rows are zero left of the block, the mask drops the block)
        upd = jax.lax.dynamic_slice_in_dim(U, i1, B, axis=0).T @ E1              # [Kp, N]
        Wt = Wt - jnp.where(rows[:, None] >= i1 + B, upd, 0.0)
        return (Wt, s, z), (Q1, C1, S1, Z1, jnp.sum(E1 * E1))

    ones = jnp.ones((N,), jnp.float32)
    _, (*outs, e2) = jax.lax.scan(block, (Wt, ones, ones), jnp.arange(0, Kp, B))
    Q, C, S, Z = (o.reshape(Kp, N)[:K][inv].T for o in outs)  # original order, [N, K]
    return Q, C, S, Z, e2, jnp.sum(jnp.square(W - Q))


def core_kwargs(spec: QuantSpec, scale_dtype=jnp.float16) -> dict:
    """The static settings `_gptq_core` is compiled for (also what amdllm.quant.calibrate compiles ahead)."""
    return dict(maxq=spec.maxq, sym=spec.sym, G=spec.group_size, B=spec.blocksize,
                static_groups=spec.static_groups and spec.group_size != -1, scale_dtype=jnp.dtype(scale_dtype).name,
                mse=spec.mse)


@jax.jit
def _mend_dead(H):
    """(H with a dead column's zero diagonal set to 1, H's diagonal): one compiled call, not 3 eager ops."""
    diag = jnp.diag(H)
    return H + jnp.diag((diag == 0).astype(H.dtype)), diag


def gptq_quantize(W, H, spec: QuantSpec, scale_dtype=jnp.float16, where: str = "layer") -> QuantResult:
    """W [N, K] float32, H [K, K] (any positive scale) -> QuantResult. The reference loop (module doc)."""
    W = jnp.asarray(W, jnp.float32)
    H = jnp.asarray(H, jnp.float32)
    N, K = W.shape
    if H.shape != (K, K):
        raise GPTQError(f"{where}: Hessian shape {H.shape} does not match in_features {K}")
    G = spec.groups(K, where)
    if spec.group_size != -1 and G % spec.blocksize and spec.blocksize % G:
        raise GPTQError(f"{where}: group_size {G} and blocksize {spec.blocksize} must divide one another")
    kw = core_kwargs(spec, scale_dtype)
    H, diag = _mend_dead(H)      # only the diagonal decides dead columns and the order (act-order)
    diag = np.asarray(diag)
    dead = diag == 0
    live = np.where(dead, 1.0, diag)
    if spec.act_order:
        perm = np.argsort(-live, kind="stable")
    elif gar_applies(spec):
        perm = group_aware_order(live, G)
    else:
        perm = np.arange(K)
    if spec.act_order or gar_applies(spec):  # otherwise perm is the identity: no [K, K] gathers
        H = H[perm][:, perm]
    U, p = hessian_inverse(H, spec.percdamp, where)  # H moves to the host only to be factored there
    # device_put, not jnp.asarray: the latter compiles a small "stage" program per shape and dtype
    Q, C, S, Z, e2, d2 = (np.asarray(a) for a in _gptq_core(W, U, jax.device_put(dead), jax.device_put(perm), **kw))
    # the solve's own error: W - Q = E U, with U^T U = (H' + damp I)^-1 for the mended H', so
    # sum(E^2) = tr((W-Q)(H' + damp I)(W-Q)^T), and H' differs from H only on dead columns, where W - Q = 0
    damp = p * mean_diagonal(np.where(dead, 1.0, diag))  # the mended H's diagonal, as hessian_inverse saw it
    err = float(np.sum(e2, dtype=np.float64)) - damp * float(d2)
    inv = np.argsort(perm)
    if spec.act_order and not kw["static_groups"]:
        g_idx = (inv // G).astype(np.int32)  # g_idx[k] = (position of column k in perm) // G
    else:
        g_idx = (np.arange(K) // G).astype(np.int32)
    ng = K // G
    scales, zeros = np.zeros((ng, N), np.float32), np.zeros((ng, N), np.int32)
    scales[g_idx], zeros[g_idx] = S.T, Z.T.astype(np.int32)  # every column of a group agrees
    return QuantResult(Q, C.astype(np.int32), scales, zeros, g_idx, p, err)


def gar_applies(spec: QuantSpec) -> bool:
    """Group-aware ordering runs where act-order does not and the groups are formed during the solve."""
    return spec.act_group_aware and not spec.act_order and not spec.static_groups and spec.group_size != -1


def group_aware_order(diag: np.ndarray, G: int) -> np.ndarray:
    """GPTQModel's act_group_aware order (its `gar` module): within each group of G consecutive
    columns, by decreasing diag(H); whole groups by their largest diag(H). A group keeps its columns, so
    the checkpoint's g_idx is k // G and inference needs no reordering, while the solve still meets the
    inputs that matter most first, as act-order does. perm[new position] = old column."""
    d = np.asarray(diag).reshape(-1, G)
    local = np.argsort(-d, axis=1, kind="stable")
    order = np.argsort(-d.max(axis=1), kind="stable")
    return (local + (np.arange(d.shape[0]) * G)[:, None])[order].reshape(-1)


@jax.jit
def _recon_err(W, Q, H):
    d = W - Q
    return jnp.sum((d @ H) * d)


def reconstruction_error(W, Q, H) -> float:
    """||W X - Q X||^2 per token, from H = (1/n) sum x x^T (the raw second moment): tr(dW H dW^T)."""
    return float(_recon_err(*(jnp.asarray(a, jnp.float32) for a in (W, Q, H))))


@partial(jax.jit, static_argnames=("maxq", "sym", "G", "scale_dtype", "mse"))
def _rtn_error(W, H, h_scale, *, maxq, sym, G, scale_dtype, mse=False):
    return _recon_err(W, _rtn_core(W, maxq=maxq, sym=sym, G=G, scale_dtype=scale_dtype, mse=mse)[0], H * h_scale)


def rtn_error(W, H, spec: QuantSpec, scale_dtype=jnp.float16, h_scale: float = 1.0) -> float:
    """reconstruction_error of RTN on GPTQ's grid for the second moment h_scale * H, in one compiled
    call: calibration reports it beside GPTQ's own (`QuantResult.err`) for every linear."""
    W, H = (jax.device_put(np.asarray(a, np.float32)) if isinstance(a, np.ndarray) else
            jnp.asarray(a, jnp.float32) for a in (W, H))
    return float(_rtn_error(W, H, jnp.float32(h_scale), **errors_kwargs(spec, W.shape[1], scale_dtype)))


def errors_kwargs(spec: QuantSpec, K: int, scale_dtype=jnp.float16) -> dict:
    """The static settings `_rtn_error` is compiled for, in_features K (also amdllm.quant.calibrate's compile-ahead)."""
    return dict(maxq=spec.maxq, sym=spec.sym, G=spec.groups(K), scale_dtype=jnp.dtype(scale_dtype).name,
                mse=spec.mse)
