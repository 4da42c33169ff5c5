"""device="amd": runner/queue.py's queue device on an AMD GPU through usbgpu/ and am/; this file
is its verbs.

open(): bring the GPU up (am/driver.py), copy the code object's loadable segments and the
weights into VRAM through the DMA window. alloc(): VRAM, zero-filled, not host-visible, so
runner/queue.py copies bound host arrays in (submit) and out (wait) with upload/download.
record(): the graph's kernargs and one indirect buffer per entry point's launch range
(am/graph.py: recorded once); patch() rewrites a slot's 8-byte pointers in the kernargs. kick():
the changed kernarg pointers and the submission's staged inputs (which upload() collects while
submit runs) as DMA_DATA copies, then INDIRECT_BUFFER + RELEASE_MEM of the timeline value, in
one staging write and one doorbell; completed() reads the timeline. Every USB step is bounded
by the caller's deadline. set_profiling(): a second stream per launch range that writes the GPU
clock counter (RELEASE_MEM) before and after each launch.

A lost device (unplug, transfer error) is DeviceError; reset() opens the enclosure again and
repeats the bring-up and every allocation in its order (the blob stays mapped), so a replugged
GPU runs the model again at the same addresses. What VRAM held (state included) survives only
where the GPU kept it: the mock does; docs/amd.md says what hardware must show.
"""
from __future__ import annotations

import time

from am import elf, graph, pm4
from am.driver import TIMELINE_AT, Gpu
from runner.errors import BlobError, DeviceError
from runner.format import Region
from runner.queue import Memory, QueueDevice

TARGET = "amd"
LOAD_TIMEOUT_S = 600.0  # a whole model's weights over USB: minutes at worst, never forever
USB_TIMEOUT_S = 1.0  # per batch of USB transfers
STATE_IO_S = 10.0  # a state read or written between runs


class AmdDevice(QueueDevice):
    name = "amd"
    staged_by_copy = True
    tick_ns = 1e9 / pm4.CLOCK_HZ  # profiled streams write the GPU clock counter (runner/queue.py)

    def __init__(self):
        self.gpu = None
        self.inputs = None  # during submit: the inputs it copies in, sent with the kick

    def check_target(self, target: str) -> None:
        if target != TARGET:
            raise BlobError(f"device 'amd' runs target {TARGET!r} blobs, got {target!r}")

    def open(self, blob) -> None:
        self.blob = blob
        self.co = elf.read(bytes(blob.programs))
        self.allocs: list[tuple[int, int]] = []  # (bytes, address) after the bring-up's own
        self._bring_up(time.monotonic() + LOAD_TIMEOUT_S)

    def _bring_up(self, deadline: float) -> None:
        from usbgpu.pci import UsbPci
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None
        self.gpu = gpu = Gpu(UsbPci(USB_TIMEOUT_S))
        blob, image = self.blob, bytes(self.blob.programs)
        self.code = gpu.alloc(self.co.size, deadline)
        for va, data in elf.load_image(image):
            gpu.upload(self.code + va, data, deadline)
        self.arena = gpu.alloc(blob.arena_bytes, deadline)
        self.weights = gpu.alloc(len(blob.weights), deadline)
        gpu.upload(self.weights, blob.weights, deadline)
        self.kernargs = gpu.alloc(256 * len(blob.launches) + 4096, deadline)
        self.submitted = 0

    def alloc(self, nbytes: int) -> Memory:
        va = self._vram(nbytes)
        self.gpu.upload(va, bytes(max(nbytes, 1)), time.monotonic() + LOAD_TIMEOUT_S)
        return Memory(va, None, nbytes)

    def _vram(self, nbytes: int) -> int:
        """VRAM after the bring-up's own, logged: reset() asks for it again in this order."""
        va = self.gpu.alloc(nbytes, time.monotonic() + LOAD_TIMEOUT_S)
        self.allocs.append((nbytes, va))
        return va

    def map_host(self, slot: int, array):
        return None

    def submit(self, deadline: float, launches: range | None = None) -> int:
        self.inputs = []
        try:
            return super().submit(deadline, launches)
        finally:
            self.inputs = None

    def upload(self, mem: Memory, data) -> None:
        if self.inputs is not None:  # a staged input of the submission: goes with its kick
            self.inputs.append((mem.address, memoryview(data).cast("B")))
            return
        self.gpu.upload(mem.address, memoryview(data).cast("B"), self._deadline())

    def download(self, mem: Memory) -> bytes:
        out = bytearray(mem.nbytes)
        self.gpu.download(mem.address, memoryview(out), self._deadline())
        return bytes(out)

    def _deadline(self) -> float:
        return time.monotonic() + (USB_TIMEOUT_S if self.value > self.retired else STATE_IO_S)

    def _address(self, b: int) -> int:
        spec = self.blob.buffers[b]
        if spec.region is Region.ARENA:
            return self.arena + spec.offset
        if spec.region is Region.WEIGHTS:
            return self.weights + spec.offset
        return self.io_address[spec.slot]

    def record(self) -> None:
        """The kernargs and each entry's stream; a re-recording (reset) writes them where the
        first one put them."""
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        self.rec = rec = graph.record(self.blob, self.co, self.code, self.kernargs, self._address)
        self.gpu.upload(self.kernargs, bytes(rec.kernargs), deadline)
        self.dirty = None  # all of it is on the GPU now, every slot at its current address
        ranges = sorted({range(len(self.blob.launches))} | {e.launches for e in self.graph.entries},
                        key=lambda r: (r.start, r.stop))
        streams = getattr(self, "streams", {})  # (launch range, profiled) -> (IB, dwords)
        stamps = None if self.stamps is None else self.stamps.address
        for key in [(r, profiled) for profiled in (False, stamps is not None) for r in ranges]:
            words = rec.stream(key[0], stamps if key[1] else None)
            ib = streams[key][0] if key in streams else self._vram(4 * max(len(words), 1))
            self.gpu.upload(ib, b"".join(w.to_bytes(4, "little") for w in words), deadline)
            streams[key] = (ib, len(words))
        self.streams = streams

    def set_profiling(self, on: bool) -> None:
        """Profiled streams write the GPU clock counter into `stamps` around each launch;
        recorded beside the plain ones the first time (kick picks by self.profiling)."""
        if on and (range(len(self.blob.launches)), True) not in self.streams:
            self.record()

    def patch(self, slot: int, address: int) -> None:
        """The slot's pointers, in the kernargs' host copy: the span patched since the last kick
        goes with it as one copy (a state's slots are patched every run: one DMA_DATA each
        would outgrow a staging write's copies)."""
        for off in self.rec.slots.get(slot, ()):
            self.rec.kernargs[off:off + 8] = address.to_bytes(8, "little")
            lo, hi = self.dirty or (off, off + 8)
            self.dirty = min(lo, off), max(hi, off + 8)

    def kick(self, launches: range, deadline: float, value: int) -> None:
        """The patched kernarg pointers, the staged inputs and the range's stream in one
        staging write and one doorbell (more when the inputs outgrow the staging memory)."""
        pieces = self.inputs
        if self.dirty:
            lo, hi = self.dirty
            pieces = [(self.kernargs + lo, bytes(self.rec.kernargs[lo:hi])), *pieces]
            self.dirty = None
        ib, dwords = self.streams[launches, self.profiling]
        self.submitted = value
        self.gpu.put_then(pieces, pm4.indirect_buffer(ib, dwords) +
                          pm4.release_mem(self.gpu.window + TIMELINE_AT, value), deadline)

    def completed(self) -> int:
        return self.gpu.timeline()

    def reset(self) -> None:
        """A fresh bring-up, then every allocation again in its order: the same addresses, so
        the io memory, staging copies, state and streams the queue holds stay valid."""
        self._bring_up(time.monotonic() + LOAD_TIMEOUT_S)
        for nbytes, va in self.allocs:
            if self.gpu.alloc(nbytes, time.monotonic() + LOAD_TIMEOUT_S) != va:
                raise DeviceError(f"amd: after the bring-up, {nbytes} bytes of VRAM came back "
                                  f"at another address than {va:#x}")
        self.record()

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None
