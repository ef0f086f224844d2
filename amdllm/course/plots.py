"""Figures for the course notebooks. Every function returns a matplotlib `Figure` and never saves it.

The figures are built with pyplot and then closed, so a notebook cell that ends with `fig` shows the
figure exactly once (Jupyter's inline backend renders returned Figure objects), and a headless run
does not accumulate open figures.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import jax
import matplotlib.pyplot as plt
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from amdllm.parallel.sharding import ShardingError, param_specs

COLORS = plt.get_cmap("tab10").colors


def _done(fig):
    fig.tight_layout()
    plt.close(fig)  # returned, not auto-shown: the caller decides to display it
    return fig


def parity_per_layer(diffs: Sequence[float], tol: float | None = None, labels: Sequence[str] | None = None,
                     title: str = "amdllm vs transformers: max |difference| after each layer"):
    """Bar chart (log scale) of the max absolute difference measured after each layer."""
    diffs = np.maximum(np.asarray(diffs, dtype=float), 1e-12)  # log scale: an exact 0 drawn at 1e-12
    labels = list(labels) if labels is not None else [f"layer {i}" for i in range(len(diffs))]
    fig, ax = plt.subplots(figsize=(max(5, 0.7 * len(diffs) + 2), 3.2))
    ax.bar(labels, diffs, color=COLORS[0])
    ax.set_yscale("log")
    if tol is not None:
        ax.axhline(tol, color="red", ls="--", lw=1, label=f"tolerance {tol:g}")
        ax.legend(loc="upper right")
        ax.set_ylim(top=max(tol, diffs.max()) * 30)  # room above the line for the legend
    ax.set_ylabel("max |ours - transformers|")
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=45 if len(diffs) > 6 else 0)
    return _done(fig)


def loss_curve(steps: Sequence[int], losses: Sequence[float], *, eval_points: Mapping[int, float] | None = None,
               tokens_per_second: Sequence[float] | None = None, title: str = "training loss"):
    """Loss per step (raw and smoothed), optional eval points, optional tokens/s on a second panel."""
    steps, losses = np.asarray(steps), np.asarray(losses, dtype=float)
    panels = 2 if tokens_per_second is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 3.4), squeeze=False)
    ax = axes[0, 0]
    ax.plot(steps, losses, color=COLORS[0], alpha=0.35, lw=1, label="loss per step")
    k = max(1, len(losses) // 15)  # moving average over ~1/15 of the run
    if len(losses) > 2 * k > 2:
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1:], smooth, color=COLORS[0], lw=2, label=f"moving average ({k} steps)")
    if eval_points:
        ax.plot(list(eval_points), list(eval_points.values()), "o-", color=COLORS[1], label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per target token)")
    ax.set_title(title)
    ax.legend()
    if panels == 2:
        ax2 = axes[0, 1]
        tps = np.asarray(tokens_per_second, dtype=float)
        ok = tps > 0  # a step that included compilation is logged as 0
        ax2.plot(steps[: len(tps)][ok], tps[ok], color=COLORS[2])
        ax2.set_xlabel("step")
        ax2.set_ylabel("tokens / s")
        ax2.set_title("training throughput")
        ax2.set_ylim(bottom=0)
    return _done(fig)


def _device_grid(ax, shape, sharding, title: str, axis_labels=("dim 0", "dim 1")):
    """Draw a 2-D array's index space, one rectangle per shard, labelled with the device(s) holding it."""
    rows, cols = shape
    owners: dict[tuple, list[int]] = {}
    for dev, idx in sharding.devices_indices_map(tuple(shape)).items():
        r, c = idx[0].indices(rows), idx[1].indices(cols)
        owners.setdefault((r[0], r[1], c[0], c[1]), []).append(dev.id)
    for (r0, r1, c0, c1), devs in sorted(owners.items()):
        color = COLORS[min(devs) % len(COLORS)]
        ax.add_patch(plt.Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=color, alpha=0.55, edgecolor="black"))
        ax.text((c0 + c1) / 2, (r0 + r1) / 2, "d" + ",".join(map(str, sorted(devs))),
                ha="center", va="center", fontsize=10)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(f"{axis_labels[1]} ({cols})", fontsize=9)
    ax.set_ylabel(f"{axis_labels[0]} ({rows})", fontsize=9)
    ax.tick_params(labelsize=8)


def sharding_pictures(arrays: Mapping[str, object], ncols: int = 3, axis_labels=("dim 0", "dim 1")):
    """One panel per {title: 2-D jax.Array (or (shape, sharding))}: who holds which block of the weight."""
    n = len(arrays)
    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 3.2 * nrows), squeeze=False)
    for ax, (title, a) in zip(axes.flat, arrays.items()):
        shape, sharding = a if isinstance(a, tuple) else (a.shape, a.sharding)
        if len(shape) != 2:
            raise ValueError(f"sharding_pictures: {title!r} has shape {tuple(shape)}; expected a 2-D array")
        _device_grid(ax, shape, sharding, title, axis_labels)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    return _done(fig)


def layer_sharding(cfg, mesh, rules, ncols: int = 4):
    """The seven projections of one decoder layer ([in, out] each), cut into the blocks each device holds.

    The norms are left out (replicated on every device under every preset; the title says so), so the
    panels stay large enough to read the device ids."""
    arrays = {}
    for name, (shape, _, spec, _) in param_specs(cfg, mesh, rules).items():
        if not name.startswith("layers/") or len(shape) != 3:
            continue
        spec = tuple(spec) + (None,) * (3 - len(tuple(spec)))   # drop the stacked `layers` axis
        one = P(*spec[1:])
        arrays[f"{name.split('/', 1)[1]}  P{tuple(one)}"] = (shape[1:], NamedSharding(mesh, one))
    fig = sharding_pictures(arrays, ncols=ncols, axis_labels=("in", "out"))
    desc = ", ".join(f"{a}={n}" for a, n in dict(mesh.shape).items())
    fig.suptitle(f"one decoder layer on mesh ({desc}), rules '{rules}': labels = devices holding each block "
                 "(norms: a full copy on every device)", fontsize=10)
    fig.tight_layout()
    return fig


def quant_grid(weights: np.ndarray, dequantized: np.ndarray, *, bits: int,
               title: str = "one group of weights and its quantization grid"):
    """Original weights (dots) vs their quantized values (crosses), with the grid's levels as lines."""
    w, q = np.asarray(weights, float).ravel(), np.asarray(dequantized, float).ravel()
    fig, ax = plt.subplots(figsize=(8, 3.4))
    for level in np.unique(np.round(q, 7)):
        ax.axhline(level, color="gray", lw=0.5, alpha=0.6)
    x = np.arange(len(w))
    ax.vlines(x, w, q, color=COLORS[3], lw=0.8, label="rounding error")
    ax.plot(x, w, ".", color=COLORS[0], label="original weight")
    ax.plot(x, q, "x", color=COLORS[1], ms=4, label=f"{bits}-bit value")
    ax.set_xlabel("position in the group")
    ax.set_ylabel("value")
    ax.set_title(f"{title} ({2 ** bits} levels)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return _done(fig)


def error_comparison(errors: Mapping[str, Sequence[float]], *, xlabel: str, ylabel: str, title: str,
                     logy: bool = False):
    """Lines of an error measure along some axis, one per method (e.g. RTN vs GPTQ per output column)."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for i, (name, errs) in enumerate(errors.items()):
        ax.plot(np.arange(len(errs)), np.asarray(errs, float), color=COLORS[i], lw=1.5, label=name)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return _done(fig)


def grouped_bars(values: Mapping[str, Mapping[str, float]], *, ylabel: str, title: str, fmt: str = "{:.3g}",
                 logy: bool = False, ylim: tuple[float, float] | None = None):
    """{group: {series: value}} as grouped bars with values written on them (e.g. perplexity per method).
    ylim fixes the axis, e.g. (0, 1) for accuracies, so that 4% does not fill the plot like 100% would."""
    groups = list(values)
    series = list(dict.fromkeys(s for g in groups for s in values[g]))
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(5.5, 1.3 * len(groups) * max(1, len(series)) / 2 + 2), 3.6))
    for i, s in enumerate(series):
        xs = np.arange(len(groups)) + (i - (len(series) - 1) / 2) * width
        ys = [values[g].get(s, np.nan) for g in groups]
        bars = ax.bar(xs, ys, width, label=s, color=COLORS[i % len(COLORS)])
        for b, y in zip(bars, ys):
            if np.isfinite(y):
                ax.annotate(fmt.format(y), (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom",
                            fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(np.arange(len(groups)), groups)
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend(fontsize=8)
    ax.margins(y=0.15)
    if ylim is not None:
        ax.set_ylim(*ylim)
    return _done(fig)


def memory_breakdown(parts: Mapping[str, float], *, capacity_gb: float | None = None,
                     title: str = "memory per device"):
    """One horizontal stacked bar of GB per part (weights, LoRA, optimizer, ...) against the capacity."""
    fig, ax = plt.subplots(figsize=(9, 2.2))
    left = 0.0
    for i, (name, gb) in enumerate(parts.items()):
        if gb <= 0:
            continue
        ax.barh([0], [gb], left=left, color=COLORS[i % len(COLORS)], label=f"{name}: {gb:.3g} GB")
        left += gb
    if capacity_gb is not None:
        ax.axvline(capacity_gb, color="red", lw=2, ls="--", label=f"capacity {capacity_gb:g} GB")
    ax.set_yticks([])
    ax.set_xlabel("GB per device")
    ax.set_xlim(0, max(left, capacity_gb or 0) * 1.05 or 1)
    fits = "" if capacity_gb is None else ("  -> fits" if left <= capacity_gb else "  -> does NOT fit")
    ax.set_title(f"{title}: {left:.3g} GB{fits}")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    return _done(fig)


def size_vs_quality(points: Mapping[str, tuple[float, float]], *, xlabel: str = "size on disk (MB)",
                    ylabel: str = "perplexity (lower is better)", title: str = "size vs quality"):
    """Scatter of {label: (size, metric)}: the trade-off a quantization method buys."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for i, (label, (x, y)) in enumerate(points.items()):
        ax.plot([x], [y], "o", ms=9, color=COLORS[i % len(COLORS)])
        ax.annotate(label, (x, y), xytext=(6, 4), textcoords="offset points", fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.margins(0.2)
    return _done(fig)


def _layer_view(shape, spec):
    """Drop the leading `layers` axis of a stacked parameter: one layer's 2-D (or 1-D) picture."""
    spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    return shape[1:], P(*spec[1:])


def show_array_sharding(x, mesh: Mesh | None = None, spec=None, **kw):
    """`jax.debug.visualize_array_sharding` for 2-D arrays; a stacked [L, a, b] array shows one layer.

    Pass an array (its own sharding is drawn) or a shape with `mesh` and `spec`.
    """
    if isinstance(x, tuple):  # a shape: draw the layout the spec would give
        shape, sharding = x, NamedSharding(mesh, spec)
    else:
        shape, sharding = x.shape, x.sharding
    if len(shape) == 3:
        shape, spec2 = _layer_view(shape, sharding.spec)
        sharding = NamedSharding(sharding.mesh, spec2)
    if len(shape) != 2:
        raise ShardingError(f"show_array_sharding draws 2-D arrays (or one layer of a 3-D stack); got shape {shape}")
    return jax.debug.visualize_sharding(shape, sharding, **kw)
