"""PNG plots for the report: accuracy histograms, modeled HBM bytes, speedups. matplotlib, Agg.

The drawing helpers (``draw_accuracy``, ``draw_speedup``) take an Axes and return what they decided
(bins, axis range, best anchors), so tests can check them without looking at pixels.
"""
from __future__ import annotations

import math
from pathlib import Path

EAGER = "eager unfused"

# One colour per dtype, in every plot: the bars of a dtype and its bound line share it.
DTYPE_COLORS = {"fp32": "#1f77b4", "fp16": "#ff7f0e", "bf16": "#2ca02c", "fp8": "#9467bd"}
_EXTRA_COLORS = ["#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]
_HATCHES = ["", "////", "....", "xxxx", "\\\\\\\\", "oo"]
ANCHOR_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
EAGER_COLOR = "#7f7f7f"
BINS_PER_DECADE = 8
FLOOR = 1e-12  # rel-L2 of exactly 0 is drawn here (a log axis has no 0)


def dtype_color(dtype: str) -> str:
    if dtype in DTYPE_COLORS:
        return DTYPE_COLORS[dtype]
    return _EXTRA_COLORS[sum(map(ord, dtype)) % len(_EXTRA_COLORS)]


def _finite_float(v):
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _rel_values(a: dict) -> list[float]:
    vals = [_finite_float(v) for v in a.get("rel_l2", [])]
    return [max(v, FLOOR) for v in vals if v is not None]


def accuracy_bins(accuracy: list[dict]):
    """Log-spaced bin edges shared by every series of one accuracy plot: they span all seeds' rel-L2 of
    all cases (each series binned over its own range would give sub-pixel bars on the shared log axis)."""
    import numpy as np

    vals = [v for a in accuracy for v in _rel_values(a)]
    if not vals:
        return np.logspace(-8, -1, 7 * BINS_PER_DECADE + 1)
    lo, hi = math.log10(min(vals)), math.log10(max(vals))
    # whole bins of 1/BINS_PER_DECADE decade, with at least half a bin of margin each side
    start = math.floor(lo * BINS_PER_DECADE - 0.5) / BINS_PER_DECADE
    stop = math.ceil(hi * BINS_PER_DECADE + 0.5) / BINS_PER_DECADE
    n = max(int(round((stop - start) * BINS_PER_DECADE)), 4)
    return np.logspace(start, start + n / BINS_PER_DECADE, n + 1)


def draw_accuracy(ax, op_name: str, accuracy: list[dict]) -> dict:
    """Stacked histogram of rel-L2 over seeds, shared log bins, one colour per dtype (hatch tells the cases
    of one dtype apart), each dtype's bound(s) dashed in its colour. Returns bins, series and bounds."""
    from matplotlib import ticker
    from matplotlib.lines import Line2D

    bins = accuracy_bins(accuracy)
    series, labels, colors, hatches = [], [], [], []
    seen: dict[str, int] = {}
    for a in accuracy:
        vals = _rel_values(a)
        k = seen.get(a["dtype"], 0)
        seen[a["dtype"]] = k + 1
        label = f"{a['dtype']} · {a['case']}"
        if not a.get("pass", True):
            label += " (FAILS)"
        dropped = len(a.get("rel_l2", [])) - len(vals)
        if dropped:
            label += f" ({dropped} non-finite, not drawn)"
        series.append(vals)
        labels.append(label)
        colors.append(dtype_color(a["dtype"]))
        hatches.append(_HATCHES[k % len(_HATCHES)])
    handles = []
    if series:
        # stacked: the cases of one dtype land in the same bins, and overlapping bars would hide each other
        _, _, containers = ax.hist(series, bins=bins, histtype="barstacked", color=colors, label=labels,
                                   edgecolor="white", linewidth=0.4)
        if len(series) == 1:
            containers = [containers]
        for container, hatch, label in zip(containers, hatches, labels):
            for patch in container:
                patch.set_hatch(hatch)
            container.set_label(label)
            handles.append(container)
    bounds = {}
    for a in accuracy:
        b = _finite_float(a.get("bound"))
        if b is not None:
            bounds.setdefault((a["dtype"], b), None)
    for dtype, b in bounds:
        ax.axvline(b, linestyle="--", linewidth=1.3, color=dtype_color(dtype))
        handles.append(Line2D([], [], linestyle="--", linewidth=1.3, color=dtype_color(dtype),
                              label=f"{dtype} bound {b:.0e} (dashed)"))
    ax.set_xscale("log")
    pad = 10 ** 0.25  # a quarter decade beyond the outermost bar or bound
    lo = min([bins[0]] + [b for _, b in bounds]) / pad
    hi = max([bins[-1]] + [b for _, b in bounds]) * pad
    ax.set_xlim(lo, hi)
    ax.set_xlabel("rel-L2 vs float64 (bars: seeds, colour = dtype; dashed: that dtype's bound)")
    ax.set_ylabel("seeds (stacked over cases)")
    ax.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.set_title(f"{op_name}: error over seeds")
    if handles:
        ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return {"bins": bins, "series": series, "colors": colors, "bounds": list(bounds)}


def best_anchor(row: dict):
    """(name, speedup) of the fastest anchor of one row -- the smallest anchor/tilefuse ratio -- among
    the anchors that ran ("eager unfused" included); None when none did."""
    ok = [(k, v) for k, v in (row.get("speedup") or {}).items() if _finite_float(v) is not None and v > 0]
    return min(ok, key=lambda kv: kv[1]) if ok else None


def _nice_ticks(lo: float, hi: float) -> list[float]:
    """Labelled ticks of the speedup axis: 1-1.5-2-3-5-7 per decade, thinned to 1-2-5 on a wide axis."""
    for mants in ([1, 1.25, 1.5, 2, 3, 4, 5, 7], [1, 1.5, 2, 3, 5, 7], [1, 2, 5], [1]):
        ticks = [float(f"{m * 10.0 ** e:.6g}") for e in range(-4, 6) for m in mants]
        inside = [t for t in ticks if lo <= t <= hi]
        if len(inside) <= 10:
            return inside
    return inside


def _tick_text(t: float) -> str:
    return f"{t:g}×"


def draw_speedup(ax, op_name: str, timed: list[dict]) -> dict:
    """Grouped bars of anchor ms / tilefuse ms on a log axis, from the 1× line (up: tilefuse faster). The
    best (fastest) anchor of each row is drawn solid and outlined. When other anchors exist, the axis is
    set by them and "eager unfused" values outside it are clipped to the edge with their number written
    there. Returns the axis range, the anchors drawn and each row's best anchor."""
    from matplotlib import ticker
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    anchors = sorted({a for r in timed for a in (r.get("speedup") or {})}, key=lambda a: (a == EAGER, a))
    others = [a for a in anchors if a != EAGER]
    vals = lambda names: [v for r in timed for a in names  # noqa: E731
                          if (v := _finite_float((r.get("speedup") or {}).get(a))) is not None and v > 0]
    scale_vals = vals(others) or vals(anchors) or [1.0]
    lo = min(min(scale_vals), 1.0) / 1.25
    hi = max(max(scale_vals), 1.0) * 1.25
    if hi / lo < 2.5:  # at least a little room around 1x, so small differences stay readable
        mid = math.sqrt(lo * hi)
        lo, hi = mid / 1.58, mid * 1.58
    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    best = [best_anchor(r) for r in timed]
    w = 0.8 / max(len(anchors), 1)
    clipped, failed_x = [], []
    def anchor_color(a):
        return EAGER_COLOR if a == EAGER else ANCHOR_COLORS[others.index(a) % len(ANCHOR_COLORS)]

    for i, a in enumerate(anchors):
        color = anchor_color(a)
        for x, (r, b) in enumerate(zip(timed, best)):
            xpos = x + i * w - 0.4 + w / 2
            raw = (r.get("speedup") or {}).get(a, "absent")
            if raw == "absent":
                continue
            v = _finite_float(raw)
            if v is None or v <= 0:  # the anchor failed (or did not run) on this shape
                failed_x.append(xpos)
                continue
            is_best = b is not None and b[0] == a
            if v > hi or v < lo:  # off the scale the other anchors set: a marker at the edge, with its value
                clipped.append((a, x, v))
                edge = hi if v > hi else lo
                ax.plot([xpos], [edge], marker="^" if v > hi else "v", color=color, clip_on=False, zorder=4,
                        markersize=8 if is_best else 6, markeredgecolor="black",
                        markeredgewidth=1.6 if is_best else 0.6, alpha=1.0 if is_best else 0.8)
                ax.annotate(f"{v:.3g}×", (xpos, edge), xytext=(0, -7 if v > hi else 7),
                            textcoords="offset points", ha="center", va="top" if v > hi else "bottom",
                            fontsize=6, fontweight="bold" if is_best else "normal", zorder=5)
                continue
            ax.bar(xpos, v - 1.0, w * 0.92, bottom=1.0, color=color, alpha=1.0 if is_best else 0.45,
                   edgecolor="black" if is_best else "none", linewidth=1.4 if is_best else 0, zorder=2)
            if is_best:
                ax.annotate(f"{v:.3f}" if v < 10 else f"{v:.3g}", (xpos, v), xytext=(0, 2 if v >= 1 else -2),
                            textcoords="offset points", ha="center", va="bottom" if v >= 1 else "top",
                            fontsize=5.5, zorder=5)
    if failed_x:
        ax.plot(failed_x, [1.0] * len(failed_x), "x", color="#d62728", markersize=6, zorder=4)
    ax.axhline(1.0, color="black", linewidth=1.0, zorder=3)
    ticks = _nice_ticks(lo, hi)
    ax.yaxis.set_major_locator(ticker.FixedLocator(ticks))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda t, _: _tick_text(t)))
    ax.yaxis.set_minor_locator(ticker.NullLocator())
    ax.grid(axis="y", linewidth=0.4, alpha=0.5, zorder=0)
    ax.set_xticks(range(len(timed)), [f"{r['case']}\n{r['dtype']}" for r in timed], fontsize=6,
                  rotation=30, ha="right")
    ax.set_xlim(-0.6, len(timed) - 0.4)
    ax.set_ylabel("anchor ms / tilefuse ms (log)")
    ax.set_title(f"{op_name}: speedup vs each anchor (above 1× = tilefuse faster)")
    handles = [Patch(color=anchor_color(a), label=a) for a in anchors]
    handles.append(Patch(facecolor="white", edgecolor="black", linewidth=1.4,
                         label="outlined, solid: best (fastest)\nanchor of the row"))
    handles.append(Line2D([], [], color="black", linewidth=1.0, label="1× (equal time)"))
    if clipped:
        handles.append(Line2D([], [], marker="^", linestyle="none", color=EAGER_COLOR, markeredgecolor="black",
                              label="off this scale: marker at\nthe edge, value written"))
    if failed_x:
        handles.append(Line2D([], [], marker="x", linestyle="none", color="#d62728", label="anchor failed"))
    ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return {"ylim": (lo, hi), "anchors": anchors, "best": best, "clipped": clipped, "failed": len(failed_x)}


def write_op_plots(op_name: str, entry: dict, out: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    slug = op_name.replace("+", "_").replace(" ", "_")
    written = {}

    def save(fig, name):
        fig.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5), layout="constrained")
    draw_accuracy(ax, op_name, entry["accuracy"])
    name = f"{slug}_accuracy.png"
    save(fig, name)
    written["accuracy histogram"] = name

    if entry["speed"]:
        labels = [f"{r['case']}\n{r['dtype']}" for r in entry["speed"]]
        fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels)), 3.8), layout="constrained")
        xs = range(len(labels))
        unfused = [r["hbm_bytes"]["unfused"] / 1e6 for r in entry["speed"]]
        fused = [r["hbm_bytes"]["fused"] / 1e6 for r in entry["speed"]]
        ax.bar([x - 0.2 for x in xs], unfused, 0.4, label="unfused")
        ax.bar([x + 0.2 for x in xs], fused, 0.4, label="fused")
        for x, u, f in zip(xs, unfused, fused):
            if u > 0:
                saved = 1 - f / u
                text = "±0%" if abs(saved) < 0.005 else f"-{saved:.0%}" if saved < 0.995 else f"-{saved:.1%}"
                ax.annotate(text, (x + 0.2, f), xytext=(0, 2), textcoords="offset points",
                            ha="center", va="bottom", fontsize=6)
        ax.set_yscale("log")  # fused traffic can be 1000x below unfused (attention): linear would hide it
        ax.set_xticks(list(xs), labels, fontsize=6, rotation=30, ha="right")
        ax.set_ylabel("modeled HBM MB (log)")
        ax.set_title(f"{op_name}: minimum HBM traffic (label: fused saves)")
        ax.legend()
        name = f"{slug}_bytes.png"
        save(fig, name)
        written["HBM bytes"] = name

        timed = [r for r in entry["speed"] if r.get("speedup")]
        if timed:
            fig, ax = plt.subplots(figsize=(max(7, 0.75 * len(timed) + 2), 4.0), layout="constrained")
            draw_speedup(ax, op_name, timed)
            name = f"{slug}_speedup.png"
            save(fig, name)
            written["speedup"] = name
    return written
