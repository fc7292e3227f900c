"""The loss-against-hit-rate picture both A/B entry points draw (``offload_ab`` at batch 1, ``sessions_ab`` at many
sessions): each workload's pooled offload loss at its decode hit rate, the spread of its pairs, and the physical
floor (misses x row bytes over the zero-copy bandwidth measured in the same run, as a share of the resident step)."""


def floor_pct(misses_per_step: float, row_bytes: int, host_bw: dict | None, resident_step_s: float) -> float | None:
    """The physical floor of an offload loss in % of the resident step; None without a bandwidth measurement."""
    if not host_bw or resident_step_s <= 0:
        return None
    return 100 * misses_per_step * row_bytes / host_bw["bandwidth_Bps"] / resident_step_s


def plot(points: list[dict], path: str, title: str) -> str | None:
    """``points``: ``{"label", "hit_rate" (0-1), "loss_pct", "loss_min", "loss_max", "floor_pct" (or None)}``.
    Writes a PNG to ``path`` and returns it, or says why there is no plot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return f"no plot: {err}"
    points = [p for p in points if p.get("hit_rate") is not None]
    if not points:
        return "no plot: no workload with a hit rate"
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    x = [100 * p["hit_rate"] for p in points]
    ax.plot(x, [p["loss_pct"] for p in points], "o", label="offload loss (pooled pairs)")
    for i, (p, xi) in enumerate(zip(points, x)):
        ax.annotate(p["label"], (xi, p["loss_pct"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.vlines(xi, p["loss_min"], p["loss_max"], alpha=0.4,
                  label="lowest to highest pair" if i == 0 else None)
    floors = [(xi, p["floor_pct"]) for p, xi in zip(points, x) if p.get("floor_pct") is not None]
    if floors:
        fx, fy = zip(*sorted(floors))
        ax.plot(fx, fy, "k--", label="physical floor: misses x row bytes / zero-copy bandwidth")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("decode hit rate (%)")
    ax.set_ylabel("decode time lost to offload (% of resident)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
