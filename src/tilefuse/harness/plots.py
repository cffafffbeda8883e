"""PNG plots for the report: accuracy histograms, modeled HBM bytes, speedups. matplotlib, Agg."""
from __future__ import annotations

from pathlib import Path


def write_op_plots(op_name: str, entry: dict, out: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slug = op_name.replace("+", "_").replace(" ", "_")
    written = {}

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for a in entry["accuracy"]:
        vals = [max(v, 1e-12) for v in a["rel_l2"]]
        ax.hist(vals, bins=20, alpha=0.6, label=f"{a['dtype']} {a['case']}")
        ax.axvline(a["bound"], linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("rel-L2 vs float64 (dashed: bound)")
    ax.set_ylabel("seeds")
    ax.set_title(f"{op_name}: error over seeds")
    ax.legend(fontsize=6)
    fig.tight_layout()
    name = f"{slug}_accuracy.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    written["accuracy histogram"] = name

    if entry["speed"]:
        labels = [f"{r['case']}\n{r['dtype']}" for r in entry["speed"]]
        fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels)), 3.8))
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], [r["hbm_bytes"]["unfused"] / 1e6 for r in entry["speed"]], 0.4, label="unfused")
        ax.bar([x + 0.2 for x in xs], [r["hbm_bytes"]["fused"] / 1e6 for r in entry["speed"]], 0.4, label="fused")
        ax.set_xticks(list(xs), labels, fontsize=6, rotation=30, ha="right")
        ax.set_ylabel("modeled HBM MB")
        ax.set_title(f"{op_name}: minimum HBM traffic")
        ax.legend()
        fig.tight_layout()
        name = f"{slug}_bytes.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written["HBM bytes"] = name

        timed = [r for r in entry["speed"] if r.get("speedup")]
        if timed:
            anchors = sorted({a for r in timed for a in r["speedup"]})
            fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(timed)), 3.8))
            w = 0.8 / len(anchors)
            for i, a in enumerate(anchors):
                vals = [r["speedup"].get(a) or 0 for r in timed]
                ax.bar([x + i * w - 0.4 + w / 2 for x in range(len(timed))], vals, w, label=a)
            ax.axhline(1.0, color="k", linewidth=0.8)
            ax.set_xticks(range(len(timed)), [f"{r['case']}\n{r['dtype']}" for r in timed], fontsize=6,
                          rotation=30, ha="right")
            ax.set_ylabel("anchor ms / tilefuse ms")
            ax.set_title(f"{op_name}: speedup (above 1 = tilefuse faster)")
            ax.legend(fontsize=6)
            fig.tight_layout()
            name = f"{slug}_speedup.png"
            fig.savefig(out / name, dpi=110)
            plt.close(fig)
            written["speedup"] = name
    return written
