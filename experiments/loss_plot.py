"""The loss-against-hit-rate picture both A/B entry points draw (``offload_ab`` at batch 1, ``sessions_ab`` at many
sessions): each workload's pooled offload loss at its decode hit rate, the spread of its pairs, and the physical
floor (misses x row bytes over the zero-copy bandwidth measured in the same run, as a share of the resident step)."""


def floor_pct(misses_per_step: float, row_bytes: int, host_bw: dict | None, resident_step_s: float) -> float | None:
    """The physical floor of an offload loss in % of the resident step; None without a bandwidth measurement."""
    if not host_bw or resident_step_s <= 0:
        return None
    return 100 * misses_per_step * row_bytes / host_bw["bandwidth_Bps"] / resident_step_s


def sessions_ab_points(settings: dict) -> list[dict]:
    """``plot``'s points from an ``experiments.sessions_ab`` report's ``settings`` (one a workload); a committed
    report's picture is redrawn with ``plot(sessions_ab_points(report["settings"]), path, title)``."""
    return [{"label": name, "hit_rate": st["summary"]["hit_rate"], "loss_pct": st["summary"]["pooled_loss_pct"],
             "loss_min": min(st["summary"]["losses_pct"]), "loss_max": max(st["summary"]["losses_pct"]),
             "floor_pct": st["summary"]["floor_pct"]} for name, st in settings.items()]


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
    label_points(ax, [p["label"] for p in points], x, [p["loss_pct"] for p in points])
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# Label offsets tried in turn (right of the marker, above and below it, then left of it), the first whose label lies
# inside the axes and overlaps no label already placed is kept: the workloads near 99% hits sit a fraction of a point
# apart, and one fixed offset drew their names over each other and past the axes' right edge
# (sessions_ab_10x50k_loss_vs_hits_h100_0e30bf7.png as the GPU wrote it).
_LABEL_OFFSETS = ((4, 3), (4, -10), (4, 12), (4, -19), (-4, 3), (-4, -10), (-4, 12), (-4, -19), (-4, 21), (4, 21))


def label_points(ax, labels, xs, ys, fontsize: float = 7, avoid=()) -> list:
    """Annotate each point with its label inside the axes where it overlaps no marker or other label (the first offset of
    ``_LABEL_OFFSETS`` that does; the first offset if none does); the annotations, in the points' order.
    ``avoid``: more (x, y) points, unlabelled (another series'), whose markers the labels keep clear of too. Call it
    after the figure's layout is final (the overlap test is in the figure's pixels)."""
    from matplotlib.transforms import Bbox

    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    # The markers too: a label drawn across a neighbour's marker reads as that neighbour's.
    r = 4 * ax.figure.dpi / 72
    boxes = [Bbox.from_extents(u - r, v - r, u + r, v + r)
             for u, v in ax.transData.transform(list(zip(xs, ys)) + list(avoid))]
    texts = [None] * len(labels)
    for i in sorted(range(len(labels)), key=lambda j: (-xs[j], -ys[j])):  # rightmost first, as hit rates crowd there
        for dx, dy in _LABEL_OFFSETS:
            t = ax.annotate(labels[i], (xs[i], ys[i]), fontsize=fontsize, xytext=(dx, dy), textcoords="offset points",
                            ha="left" if dx > 0 else "right")
            box = t.get_window_extent(renderer)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(box.overlaps(b) for k, b in enumerate(boxes) if k != i):  # k == i: its own marker
                break
            t.remove()
        else:  # every offset overlapped: keep the first rather than drop the label
            t = ax.annotate(labels[i], (xs[i], ys[i]), fontsize=fontsize, xytext=_LABEL_OFFSETS[0],
                            textcoords="offset points")
            box = t.get_window_extent(renderer)
        boxes.append(box)
        texts[i] = t
    return texts
