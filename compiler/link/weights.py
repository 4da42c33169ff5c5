"""Weight sharing: one weights region for every variant of a model, each distinct weight stored
once (link stage). The region is anonymous memory, or the blob file itself while it is written
(compiler/blob.py BlobWriter.region), so the compile holds no second copy of the weights."""
from __future__ import annotations

import hashlib
import mmap
from collections import Counter

from runner.format import section_offsets


class Spilled(mmap.mmap):
    """A packed weight's bytes mapped back from BlobWriter.spill's scratch file."""


class Streamed(mmap.mmap):
    """A weights region mapped from the blob file being written. Its pages are let go once
    written (`release`): they stay in the page cache and go to the file from there, so the
    compile holds no second copy of the weights."""

    def release(self, start: int, size: int) -> None:
        """Unmap the whole pages of [start, start + size) from this process (the file keeps
        their bytes: a later read maps them back in)."""
        page = mmap.PAGESIZE
        lo, hi = start // page * page, (start + size) // page * page
        if hi > lo:
            self.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def weight_starts(sizes) -> tuple[list[int], int]:
    """Where weights sections of these sizes start, relative to the first, and where the last
    non-empty one ends: kernels address the shared section and their own as one region
    (runner/format.py)."""
    offsets = section_offsets(list(sizes))
    starts = [o - offsets[0] for o in offsets]
    return starts, max((s + n for s, n in zip(starts, sizes) if n), default=0)


def share_weights(builds: list, region_for=None) -> tuple[bytes, tuple[int, ...]]:
    """One weights region for every build (variant) of a model (link/buffers.py Buffers: their
    weights are moved into it): (the region, its sections' sizes). A weight
    stored with the same bytes in every build is stored once, in the shared section (content
    addressed: also a weight stored twice in one build); the rest goes to its build's own
    section, so a runner reading one build touches the shared section and its own only.
    region_for: sizes -> the writable region to lay them out in (BlobWriter.region); by default
    anonymous memory."""
    key = _content_keys([dict(b.weights) for b in builds])
    data = {k[bid]: d for b, k in zip(builds, key) for bid, d in b.weights}
    for b in builds:  # from here `data` holds each weight's bytes, until its last copy below:
        b.weights = []  # the region grows as they go, so they are not held twice over
    common = set.intersection(*(set(k.values()) for k in key))
    parts = [[h for h in key[0].values() if h in common]] + \
        [[h for h in k.values() if h not in common] for k in key]
    places, sizes = [], []
    for part in parts:
        place, size = {}, 0
        for h in part:
            if h not in place:
                place[h] = size = -(-size // builds[0].align) * builds[0].align
                size += len(data[h])
        places.append(place)
        sizes.append(size)
    starts, end = weight_starts(sizes)
    # anonymous memory: its pages are paid for as the weights are copied in, each freed after
    region = region_for(tuple(sizes)) if region_for else mmap.mmap(-1, end) if end else bytearray()
    last = {h: i for i, place in enumerate(places[1:]) for h in place}  # its last build
    last.update(dict.fromkeys(places[0], 0))  # a shared weight: the first build copies it
    shared = {h: starts[0] + off for h, off in places[0].items()}
    for i, b in enumerate(builds):
        own = {h: starts[i + 1] + off for h, off in places[i + 1].items()}
        at = {**shared, **own}
        for h, off in (own if i else at).items():  # the shared section once
            region[off:off + len(data[h])] = data[h]
            if isinstance(region, Streamed):
                region.release(off, len(data[h]))
            _let_go(data[h])
            if last[h] == i:
                del data[h]
        b.move_weights({bid: at[h] for bid, h in key[i].items()})
    return region, tuple(sizes)


def _content_keys(weights: list[dict[int, bytes]]) -> list[dict[int, object]]:
    """A key per weight that two weights share exactly when their bytes are equal: its size
    and ends, where no other weight has those, else its SHA-256. The variants pack most weights
    differently, so few are hashed (docs/perf.md)."""
    def probe(d) -> tuple:
        return len(d), bytes(d[:64]), bytes(d[-64:])
    def digest(d) -> bytes:
        h = hashlib.sha256(d).digest()
        _let_go(d)
        return h
    seen = Counter(probe(d) for w in weights for d in w.values())
    return [{bid: digest(d) if seen[probe(d)] > 1 else probe(d)
             for bid, d in w.items()} for w in weights]


def _let_go(data) -> None:
    """Unmap a spilled weight's pages once read (BlobWriter.spill): reading it again maps them
    back in from the scratch file; held, every variant's packed weights would be resident."""
    if isinstance(data, memoryview) and isinstance(data.obj, Spilled):
        data.obj.madvise(mmap.MADV_DONTNEED)
