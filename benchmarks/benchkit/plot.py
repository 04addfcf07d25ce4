"""The sweep's picture: speedup over the torch baseline against M, one panel per layer, one line per algorithm."""
import math
from typing import List, Optional

PLOTTED = ("sequential", "chunked", "fused", "auto", "baseline_fp32", "npu_mm_all_reduce_base")


def matplotlib_missing() -> Optional[str]:
    """Why no plot can be drawn here, or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    return None


def speedup_plot(path: str, title: str, layer_names: List[str], ms: List[int], points_by_layer: List[List[dict]],
                 floor: float):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on benchmark hosts
    import matplotlib.pyplot as plt

    cols = min(3, len(layer_names))
    rows = math.ceil(len(layer_names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False, sharex=True)
    for ax, name, points in zip(axes.flat, layer_names, points_by_layer):
        for key in PLOTTED:
            xs, ys = [], []
            for m, point in zip(ms, points):
                entry = point["rows"].get(key, {})
                if entry.get("available") and entry.get("speedup_vs_baseline") is not None:
                    xs.append(m)
                    ys.append(entry["speedup_vs_baseline"])
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, label=key)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(floor, color="red", linewidth=0.8, linestyle=":", label=f"{floor} x baseline")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms)
        ax.set_xticklabels([str(m) for m in ms], fontsize=7)
        ax.minorticks_off()
        ax.tick_params(labelbottom=True)  # also under panels whose column ends early
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("speedup over torch baseline")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(layer_names):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.suptitle(title, fontsize=10, y=0.995)
    top = 1 - 0.75 / fig.get_figheight()  # room for the title and, under it, the legend
    fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, top), ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)
