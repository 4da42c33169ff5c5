"""A small RGB canvas drawn with numpy and written as a PNG with zlib: rectangles, polylines and
text in a 3x5 pixel font. The tools' pictures (blobinfo --memory, profile --timeline, soak's
charts without matplotlib) need no plotting library; matplotlib stays an optional extra.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np

# 3x5 glyphs, rows top to bottom, 3 bits each ("#" on). Lower case draws as upper case.
_GLYPHS = {
    "A": "###,#.#,###,#.#,#.#", "B": "##.,#.#,##.,#.#,##.", "C": "###,#..,#..,#..,###",
    "D": "##.,#.#,#.#,#.#,##.", "E": "###,#..,##.,#..,###", "F": "###,#..,##.,#..,#..",
    "G": "###,#..,#.#,#.#,###", "H": "#.#,#.#,###,#.#,#.#", "I": "###,.#.,.#.,.#.,###",
    "J": "..#,..#,..#,#.#,###", "K": "#.#,#.#,##.,#.#,#.#", "L": "#..,#..,#..,#..,###",
    "M": "#.#,###,###,#.#,#.#", "N": "##.,#.#,#.#,#.#,#.#", "O": "###,#.#,#.#,#.#,###",
    "P": "###,#.#,###,#..,#..", "Q": "###,#.#,#.#,###,..#", "R": "##.,#.#,##.,#.#,#.#",
    "S": "###,#..,###,..#,###", "T": "###,.#.,.#.,.#.,.#.", "U": "#.#,#.#,#.#,#.#,###",
    "V": "#.#,#.#,#.#,#.#,.#.", "W": "#.#,#.#,###,###,#.#", "X": "#.#,#.#,.#.,#.#,#.#",
    "Y": "#.#,#.#,.#.,.#.,.#.", "Z": "###,..#,.#.,#..,###", "0": "###,#.#,#.#,#.#,###",
    "1": ".#.,##.,.#.,.#.,###", "2": "###,..#,###,#..,###", "3": "###,..#,###,..#,###",
    "4": "#.#,#.#,###,..#,..#", "5": "###,#..,###,..#,###", "6": "###,#..,###,#.#,###",
    "7": "###,..#,..#,..#,..#", "8": "###,#.#,###,#.#,###", "9": "###,#.#,###,..#,###",
    " ": "...,...,...,...,...", ".": "...,...,...,...,.#.", ",": "...,...,...,.#.,#..",
    ":": "...,.#.,...,.#.,...", "-": "...,...,###,...,...", "_": "...,...,...,...,###",
    "(": ".#.,#..,#..,#..,.#.", ")": ".#.,..#,..#,..#,.#.", "/": "..#,..#,.#.,#..,#..",
    "%": "#.#,..#,.#.,#..,#.#", "=": "...,###,...,###,...", "+": "...,.#.,###,.#.,...",
    "<": "..#,.#.,#..,.#.,..#", ">": "#..,.#.,..#,.#.,#..", "?": "###,..#,.##,...,.#.",
}
FONT = {c: np.array([[ch == "#" for ch in row] for row in g.split(",")], bool)
        for c, g in _GLYPHS.items()}
PALETTE = [(78, 121, 167), (242, 142, 43), (89, 161, 79), (182, 153, 45), (73, 152, 148),
           (225, 87, 89), (176, 122, 161), (255, 157, 167), (156, 117, 95), (121, 112, 110)]


class Canvas:
    def __init__(self, width: int, height: int, background=(255, 255, 255)):
        self.px = np.empty((height, width, 3), np.uint8)
        self.px[:] = background

    @property
    def size(self) -> tuple[int, int]:
        return self.px.shape[1], self.px.shape[0]

    def rect(self, x0: float, y0: float, x1: float, y1: float, color, outline=None) -> None:
        """Fill [x0, x1) x [y0, y1), at least one pixel each way; clipped to the canvas."""
        w, h = self.size
        a, b = int(np.clip(round(x0), 0, w)), int(np.clip(max(round(x1), round(x0) + 1), 0, w))
        c, d = int(np.clip(round(y0), 0, h)), int(np.clip(max(round(y1), round(y0) + 1), 0, h))
        self.px[c:d, a:b] = color
        if outline is not None and b - a > 2 and d - c > 2:
            self.px[c, a:b] = self.px[d - 1, a:b] = outline
            self.px[c:d, a] = self.px[c:d, b - 1] = outline

    def polyline(self, xs, ys, color) -> None:
        """Straight segments through the points (pixels); non-finite points are skipped, and
        what falls outside the canvas is clipped."""
        xs, ys = np.asarray(xs, float), np.asarray(ys, float)
        ok = np.isfinite(xs) & np.isfinite(ys)
        xs, ys = xs[ok], ys[ok]
        pts = [(xs, ys)] if len(xs) == 1 else []
        for ax, ay, bx, by in zip(xs, ys, xs[1:], ys[1:]):
            n = int(max(abs(bx - ax), abs(by - ay))) + 1
            pts.append((np.linspace(ax, bx, n), np.linspace(ay, by, n)))
        w, h = self.size
        for px, py in pts:
            px, py = np.rint(px).astype(int), np.rint(py).astype(int)
            inside = (px >= 0) & (px < w) & (py >= 0) & (py < h)
            self.px[py[inside], px[inside]] = color

    def text(self, x: int, y: int, s: str, color=(0, 0, 0), scale: int = 2) -> int:
        """Draw `s` with its top left at (x, y); returns the x after it. Unknown characters
        draw as '?'."""
        x, y = int(round(x)), max(int(round(y)), 0)
        for ch in s.upper():
            glyph = np.kron(FONT.get(ch, FONT["?"]), np.ones((scale, scale), bool))
            h, w = glyph.shape
            view = self.px[y:y + h, x:x + w]
            view[glyph[:view.shape[0], :view.shape[1]]] = color
            x += w + scale
        return x

    def png(self) -> bytes:
        """RGB, 8 bits per channel, every row with filter 0 (none)."""
        h, w = self.px.shape[:2]
        raw = np.concatenate([np.zeros((h, 1), np.uint8), self.px.reshape(h, 3 * w)], axis=1)
        return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) \
            + _chunk(b"IDAT", zlib.compress(raw.tobytes(), 9)) + _chunk(b"IEND", b"")

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(self.png())


def text_width(s: str, scale: int = 2) -> int:
    return len(s) * 4 * scale


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + \
        struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def read_png(data: bytes) -> np.ndarray:
    """The pixels of an 8-bit RGB, non-interlaced PNG whose rows use filter 0 (what Canvas
    writes), as (height, width, 3); ValueError for anything else."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG: bad signature")
    pos, idat, head = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0] != zlib.crc32(kind + body):
            raise ValueError(f"PNG chunk {kind!r}: CRC mismatch")
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    if head is None or head[2:] != (8, 2, 0, 0, 0):
        raise ValueError(f"expected an 8-bit RGB non-interlaced PNG, got IHDR {head}")
    w, h = head[:2]
    rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 3 * w + 1)
    if rows[:, 0].any():
        raise ValueError("rows use PNG filters other than 0")
    return rows[:, 1:].reshape(h, w, 3)
