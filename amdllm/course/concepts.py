"""The lessons' opening pictures: what each idea does, drawn with matplotlib (no data, no model).

    concepts.lora()       what LoRA adds to a frozen layer                    (lesson 03)
    concepts.sharding()   how FSDP and tensor parallelism split one weight    (lesson 02)
    concepts.gptq()       how GPTQ walks the columns and moves the error      (lesson 04)
    concepts.kv_cache()   prefill once, then one token per step               (lesson 05)
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

FROZEN, TRAINED, DONE, NOW, TODO = "#c7c7c7", "#ff7f0e", "#1f77b4", "#d62728", "#f2f2f2"


def _done(fig):
    plt.close(fig)  # returned, not auto-shown (as amdllm.course.plots): the cell displays it once
    return fig


def _box(ax, x, y, w, h, color, label="", **kw):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", lw=1, **kw))
    if label:
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=10)


def _arrow(ax, a, b, color="black"):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=12, color=color, lw=1.2))


def _canvas(w, h, title):
    fig, ax = plt.subplots(figsize=(w, h))
    ax.set_axis_off()
    ax.set_aspect("equal")
    ax.set_title(title, fontsize=11)
    return fig, ax


def lora():
    """x W (frozen, grey) plus (alpha / r) x A B (trained, orange): two thin matrices beside a big one."""
    fig, ax = _canvas(7.5, 3.2, "LoRA: y = x W + (α/r) · x A B   (W frozen; only A and B train)")
    _box(ax, 0, 1.0, 0.5, 2.0, "#ffffff", "x")
    _box(ax, 1.2, 1.5, 2.0, 2.0, FROZEN, "W\n[in, out]\nfrozen")
    _box(ax, 1.2, -0.2, 0.35, 1.4, TRAINED, "A")
    _box(ax, 1.8, 0.7, 1.4, 0.35, TRAINED, "B")
    ax.text(1.37, -0.45, "[in, r]", ha="center", fontsize=8)
    ax.text(2.5, 1.17, "[r, out], starts at 0", ha="center", fontsize=8)
    _box(ax, 4.2, 1.0, 0.5, 2.0, "#ffffff", "y")
    _arrow(ax, (0.5, 2.4), (1.2, 2.4))
    _arrow(ax, (0.5, 1.4), (1.2, 0.6))
    _arrow(ax, (3.2, 2.4), (4.2, 2.2))
    _arrow(ax, (3.2, 0.9), (4.2, 1.6), TRAINED)
    ax.text(3.7, 0.9, "× α/r", fontsize=9, color=TRAINED)
    ax.text(5.0, 2.0, "trained numbers per matrix:\nr·(in + out) instead of in·out", fontsize=9, va="center")
    ax.set_xlim(-0.2, 7.6)
    ax.set_ylim(-0.7, 3.8)
    return _done(fig)


def sharding(devices: int = 8):
    """One weight [embed, heads] on 8 devices: FSDP cuts rows, tensor parallelism cuts columns, both a grid."""
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.4))
    colors = plt.get_cmap("tab10").colors
    for ax, (title, rows, cols, note) in zip(axes, [
            ("FSDP (fsdp=8)", devices, 1, "all-gather the weight\nbefore each layer"),
            ("tensor parallel (tensor=8)", 1, devices, "keep the weight, sum\npartial outputs"),
            ("both (fsdp=4, tensor=2)", devices // 2, 2, "TP inside a group,\nFSDP across groups")]):
        ax.set_axis_off()
        ax.set_aspect("equal")
        for r in range(rows):
            for c in range(cols):
                d = r * cols + c
                _box(ax, c * 4 / cols, 4 - (r + 1) * 4 / rows, 4 / cols, 4 / rows, colors[d % 10], f"d{d}", alpha=0.55)
        ax.set_title(title, fontsize=10)
        ax.text(2, -0.6, note, ha="center", va="top", fontsize=9)
        ax.text(-0.3, 2, "embed (rows)", rotation=90, ha="center", va="center", fontsize=8)
        ax.text(2, 4.25, "heads (columns)", ha="center", fontsize=8)
        ax.set_xlim(-0.6, 4.2)
        ax.set_ylim(-1.6, 4.6)
    fig.suptitle("one weight matrix, 8 devices: the label is the device that holds each block", fontsize=11)
    fig.subplots_adjust(top=0.82)
    return _done(fig)


def gptq(columns: int = 12, now: int = 5, block: int = 4):
    """Columns left of `now` are quantized; `now` is rounded; its error is pushed onto the columns right
    of it, scaled by the inverse Hessian; blocks of columns defer the push for the far ones."""
    fig, ax = _canvas(8, 3.4, "GPTQ: round one input column, push its error onto the columns not yet rounded")
    for j in range(columns):
        color = DONE if j < now else NOW if j == now else TODO
        _box(ax, j * 0.6, 0.5, 0.55, 2.2, color)
    ax.text(now * 0.6 / 2, 2.95, "already 4-bit", ha="center", fontsize=9, color=DONE)
    ax.text(now * 0.6 + 0.27, 2.95, "now", ha="center", fontsize=9, color=NOW)
    for j in range(now + 1, columns):
        _arrow(ax, (now * 0.6 + 0.45, 1.6), (j * 0.6 + 0.27, 1.6 + 0.12 * (j - now)), NOW)
    ax.text((now + 1 + columns) * 0.3, 3.3, "not yet rounded, updated:\nW[:, j] -= err · H⁻¹[now, j] / H⁻¹[now, now]",
            ha="center", fontsize=9)
    for b in range(0, columns + 1, block):
        ax.plot([b * 0.6 - 0.025] * 2, [0.3, 2.9], color="black", lw=2 if b % block == 0 else 1, ls=":")
    ax.text(columns * 0.3, 0.05, f"dotted lines: blocks (128 columns in the real solver); "
            f"rows = output features, all rounded at once", ha="center", fontsize=8)
    ax.set_xlim(-0.3, columns * 0.6 + 0.2)
    ax.set_ylim(-0.2, 3.9)
    return _done(fig)


def kv_cache(prompt: int = 5, steps: int = 4):
    """Prefill writes the prompt's keys and values once; each decode step adds one and reads them all."""
    fig, ax = _canvas(8, 3.2, "KV cache: prefill the prompt once, then one token per step")
    for t in range(prompt + steps):
        color = DONE if t < prompt else TRAINED
        _box(ax, t * 0.7, 1.4, 0.6, 0.6, color, "K,V")
    _box(ax, (prompt + steps) * 0.7, 1.4, 0.6, 0.6, TODO, "")
    ax.text(prompt * 0.35, 2.25, "prefill: all prompt tokens in one pass", ha="center", fontsize=9, color=DONE)
    ax.text((prompt + steps / 2) * 0.7, 2.25, "decode: one new slot per step", ha="center", fontsize=9, color=TRAINED)
    q = (prompt + steps - 1) * 0.7 + 0.3
    for t in range(prompt + steps):
        _arrow(ax, (q, 0.7), (t * 0.7 + 0.3, 1.38), "#7f7f7f")
    ax.text(q, 0.45, "the new token's query reads every cached key and value", ha="center", fontsize=9)
    ax.text(0, -0.05, "cache [layers, batch, kv heads, length, head dim]; without it, step t recomputes all t tokens",
            fontsize=8)
    ax.set_xlim(-0.2, (prompt + steps + 1) * 0.7 + 0.2)
    ax.set_ylim(-0.3, 2.6)
    return _done(fig)
