"""A ring allocator over one GPU object that refuses to hand out bytes the GPU may still read.

Each allocation is tagged with the timeline value of the submission that reads it. Space is
reused in order, oldest first, and only once `retired(value)` says that submission completed (or
was abandoned by recover()). tinygrad's wrapping allocators overwrite whatever is there; here a
full ring is a DeviceError naming the submission still holding the space, never a stream the CP
reads while it is rewritten.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from runner.errors import DeviceError


class Ring:
    def __init__(self, size: int, retired: Callable[[int], bool], what: str, align: int = 64):
        self.size, self.retired, self.what, self.align = size, retired, what, align
        self.head = 0  # next free byte
        self.live: deque[tuple[int, int, int]] = deque()  # (start, end, value), oldest first

    def alloc(self, nbytes: int, value: int) -> int:
        """The offset of `nbytes` free bytes for submission `value`."""
        n = -(-nbytes // self.align) * self.align
        if n > self.size:
            raise DeviceError(f"{self.what} ring: {nbytes} bytes asked, the ring holds {self.size}")
        start = 0 if self.head + n > self.size else self.head  # never split across the end
        self._reclaim()
        for s, e, v in self.live:
            if s < start + n and start < e:  # overlaps bytes a pending submission reads
                raise DeviceError(f"{self.what} ring full: {nbytes} bytes at offset {start} are "
                                  f"still read by submission {v}, which has not retired")
        self.live.append((start, start + n, value))
        self.head = start + n
        return start

    def _reclaim(self) -> None:
        while self.live and self.retired(self.live[0][2]):
            self.live.popleft()

    def reset(self) -> None:
        """Everything abandoned (recover): the whole ring is free."""
        self.live.clear()
        self.head = 0
