"""Line charts as PNG: with matplotlib when it is installed, else with numpy and zlib alone.

    plot_png(path, title, panels)   panels: [(label, x, {series name: y}), ...] stacked vertically

The fallback draws each panel's series as polylines in a frame, with its label, the y range and
the x range, on tools/png.py's canvas. It is for a glance at trends (does RSS climb, does latency
creep), not for publication.
"""
from __future__ import annotations

import numpy as np

from tools.png import Canvas, text_width

W, H_PANEL, MARGIN = 720, 220, 34
COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]


def plot_png(path: str, title: str, panels: list) -> str:
    """Write the chart; returns which renderer drew it ("matplotlib" or "numpy")."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _raster_png(path, title, panels)
        return "numpy"
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.8 * len(panels)), sharex=True)
    for ax, (label, x, series) in zip(np.atleast_1d(axes), panels):
        for name, y in series.items():
            ax.plot(x, y, label=name, linewidth=1)
        ax.set_ylabel(label)
        ax.legend(loc="upper right", fontsize=8)
    np.atleast_1d(axes)[0].set_title(title)
    np.atleast_1d(axes)[-1].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return "matplotlib"


def _raster_png(path: str, title: str, panels: list) -> None:
    c = Canvas(W, MARGIN + H_PANEL * len(panels))
    c.text(8, 8, title)
    for k, (label, x, series) in enumerate(panels):
        _panel(c, MARGIN + k * H_PANEL, label, np.asarray(x, float), series)
    c.save(path)


def _panel(c: Canvas, top: int, label: str, x: np.ndarray, series: dict) -> None:
    x0, x1, y0, y1 = 70, W - 10, top + 22, top + H_PANEL - 24  # plot area, pixels
    ys = [np.asarray(y, float) for y in series.values()]
    finite = np.concatenate([y[np.isfinite(y)] for y in ys] + [np.zeros(0)])
    lo, hi = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1.0
    xlo, xhi = (x.min(), x.max()) if x.size else (0.0, 1.0)
    xhi = xhi if xhi > xlo else xlo + 1.0
    c.polyline([x0, x1, x1, x0, x0], [y0, y0, y1, y1, y0], (0, 0, 0))
    at = c.text(x0, top + 6, label + "  ")
    for i, (name, y) in enumerate(zip(series, ys)):
        color = COLORS[i % len(COLORS)]
        at = c.text(at, top + 6, name + "  ", color)
        c.polyline(x0 + (x - xlo) / (xhi - xlo) * (x1 - x0),
                   y1 - (y - lo) / (hi - lo) * (y1 - y0), color)
    c.text(4, y0, _num(hi))
    c.text(4, y1 - 10, _num(lo))
    c.text(x0, y1 + 6, _num(xlo))
    c.text(x1 - text_width(_num(xhi) + " s"), y1 + 6, _num(xhi) + " s")


def _num(v: float) -> str:
    return f"{v:.4g}".replace("+", "")
