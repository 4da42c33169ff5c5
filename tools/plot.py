"""Line charts as PNG: with matplotlib when it is installed, else with numpy and zlib alone.

    plot_png(path, title, panels)   panels: [(label, x, {series name: y}), ...] stacked vertically

The fallback draws each panel's series as polylines in a frame, with its label, the y range and
the x range written in a 3x5 pixel font (digits, the letters used in labels, ". - : /"). It is
for a glance at trends (does RSS climb, does latency creep), not for publication.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np

W, H_PANEL, MARGIN, SCALE = 720, 220, 34, 2
COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]
# 3x5 glyphs, rows top to bottom, "#" = ink
GLYPHS = {
    "0": "#### ## ## ####", "1": " #  #  #  #  # ", "2": "###  #####  ###", "3": "###  ###  # ###",
    "4": "# ## ####  #  #", "5": "####  ###  ####", "6": "####  #### ####", "7": "###  #  #  #  #",
    "8": "#### ##### ####", "9": "#### ####  ####", ".": "            #  ", "-": "      ###      ",
    ":": "    #     #    ", "/": "  #  # #  #  # ", " ": " " * 15,
    "A": " # # ##### ## #", "B": "## # ### # ### ", "C": " ###  #  #   ##", "D": "## # ## ## ### ",
    "E": "####  ####  ###", "F": "####  ####  #  ", "I": "### #  #  # ###", "K": "# ### ## # ## #",
    "L": "#  #  #  #  ###", "M": "# ######## ## #", "N": "# ########### #", "O": " # # ## ## # # ",
    "P": "## # ### #  #  ", "R": "## # ### # ## #", "S": " ###   #   ### ", "T": "### #  #  #  # ",
    "U": "# ## ## ## ####", "V": "# ## ## ## # # ", "Y": "# ## # #  #  # ", "H": "# ## ##### ## #",
    "G": " ###  # ## # ##", "X": "# ## # # # ## #", "=": "   ###   ###   ", "%": "# #  #  #  #  #",
}


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
    img = np.full((MARGIN + H_PANEL * len(panels), W, 3), 255, np.uint8)
    _text(img, 8, 8, title.upper())
    for k, (label, x, series) in enumerate(panels):
        _panel(img, MARGIN + k * H_PANEL, label, np.asarray(x, float), series)
    write_png(path, img)


def _panel(img, top: int, label: str, x: np.ndarray, series: dict) -> None:
    x0, x1, y0, y1 = 70, W - 10, top + 22, top + H_PANEL - 24  # plot area, pixels
    ys = [np.asarray(y, float) for y in series.values()]
    finite = np.concatenate([y[np.isfinite(y)] for y in ys] + [np.zeros(0)])
    lo, hi = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1.0
    xlo, xhi = (x.min(), x.max()) if x.size else (0.0, 1.0)
    xhi = xhi if xhi > xlo else xlo + 1.0
    img[y0:y1 + 1, [x0, x1]] = img[[y0, y1], x0:x1 + 1] = 0
    legend = "  ".join(f"{n}" for n in series)
    _text(img, x0, top + 6, f"{label}  {legend}".upper())
    for i, y in enumerate(ys):
        color = COLORS[i % len(COLORS)]
        _text(img, x0 + 8 * (len(label) + 2 + sum(len(n) + 2 for n in list(series)[:i])),
              top + 6, list(series)[i].upper(), color)
        px = x0 + (x - xlo) / (xhi - xlo) * (x1 - x0)
        py = y1 - (y - lo) / (hi - lo) * (y1 - y0)
        _polyline(img, px, py, color)
    _text(img, 4, y0, _num(hi))
    _text(img, 4, y1 - 10, _num(lo))
    _text(img, x0, y1 + 6, _num(xlo))
    _text(img, x1 - 8 * len(_num(xhi) + " S"), y1 + 6, _num(xhi) + " S")


def _num(v: float) -> str:
    return f"{v:.4g}".upper().replace("+", "")


def _polyline(img, px: np.ndarray, py: np.ndarray, color) -> None:
    ok = np.isfinite(px) & np.isfinite(py)
    px, py = px[ok], py[ok]
    for (ax, ay), (bx, by) in zip(zip(px, py), zip(px[1:], py[1:])):
        n = int(max(abs(bx - ax), abs(by - ay))) + 1
        xs = np.rint(np.linspace(ax, bx, n)).astype(int)
        ys = np.rint(np.linspace(ay, by, n)).astype(int)
        img[ys, xs] = color
    if len(px) == 1:
        img[int(py[0]), int(px[0])] = color


def _text(img, x: int, y: int, text: str, color=(0, 0, 0)) -> None:
    for ch in text:
        glyph = GLYPHS.get(ch, GLYPHS[" "])
        bits = np.array([c == "#" for c in glyph]).reshape(5, 3)
        block = np.kron(bits, np.ones((SCALE, SCALE), bool))
        h, w = block.shape
        if y + h <= img.shape[0] and x + w <= img.shape[1]:
            img[y:y + h, x:x + w][block] = color
        x += 4 * SCALE


def write_png(path: str, rgb: np.ndarray) -> None:
    """8-bit RGB PNG: signature, IHDR, one zlib IDAT (filter 0 per row), IEND."""
    h, w, _ = rgb.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + \
            struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6)) + chunk(b"IEND", b""))
