"""device="amd": the Device contract (runner/device.py v2) on an AMD GPU through usbgpu/ and am/.

load(): bring the GPU up (am/driver.py), copy the code object's loadable segments, the weights,
the graph's kernargs and its indirect buffer (am/graph.py: recorded once) into VRAM through the
DMA window, and give each io slot a VRAM buffer. Io slots are host arrays (HostDevice): submit()
copies the bound inputs into their VRAM buffers, then queues INDIRECT_BUFFER + RELEASE_MEM of
the next timeline value; completed() reads the timeline; wait() copies outputs back into the
bound arrays once their submission is complete. Every step is bounded by the caller's deadline.

A lost device (unplug, transfer error) is DeviceError; recover() opens the enclosure again and
repeats load() (the blob stays mapped), so a replugged GPU runs the model again.
"""
from __future__ import annotations

import os
import time

from am import elf, graph, pm4
from am.driver import TIMELINE_AT, Gpu
from runner.device import HostDevice, wait_until
from runner.errors import BlobError

TARGET = "amd"
LOAD_TIMEOUT_S = 600.0  # a whole model's weights over USB: minutes at worst, never forever
USB_TIMEOUT_S = 1.0  # per batch of USB transfers


class AmdDevice(HostDevice):
    name = "amd"

    def __init__(self):
        self.gpu = None

    def check_target(self, target: str) -> None:
        if target != TARGET:
            raise BlobError(f"device 'amd' runs target {TARGET!r} blobs, got {target!r}")

    def load(self, blob) -> None:
        self.blob = blob
        self.co = elf.read(bytes(blob.programs))
        self._bring_up(time.monotonic() + LOAD_TIMEOUT_S)
        self._init_io(blob)

    def _bring_up(self, deadline: float) -> None:
        from usbgpu.pci import UsbPci
        if os.environ.get("KEEL_USB") == "mock":
            import am.mock_device  # noqa: F401  registers the mock GPU behind the mock bridge
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None
        self.gpu = gpu = Gpu(UsbPci(USB_TIMEOUT_S))
        blob, image = self.blob, bytes(self.blob.programs)
        code = gpu.alloc(self.co.size, deadline)
        for va, data in elf.load_image(image):
            gpu.upload(code + va, data, deadline)
        self.arena = gpu.alloc(blob.arena_bytes, deadline)
        self.weights = gpu.alloc(len(blob.weights), deadline)
        gpu.upload(self.weights, blob.weights, deadline)
        self.slots = {b.offset: (gpu.alloc(b.nbytes, deadline), b)
                      for b in (*blob.inputs, *blob.outputs)}
        kernargs = gpu.alloc(256 * len(blob.launches) + 4096, deadline)
        rec = graph.record(blob, self.co, code, kernargs, self._address)
        gpu.upload(kernargs, bytes(rec.kernargs), deadline)
        self.ib, self.ib_dwords = gpu.alloc(4 * len(rec.ib), deadline), len(rec.ib)
        gpu.upload(self.ib, b"".join(w.to_bytes(4, "little") for w in rec.ib), deadline)
        self.submitted = self.done = 0

    def _address(self, b: int) -> int:
        spec = self.blob.buffers[b]
        if spec.region == "arena":
            return self.arena + spec.offset
        if spec.region == "weights":
            return self.weights + spec.offset
        return self.slots[spec.offset][0]

    def _patch(self, slot: int, array) -> None:
        """Nothing recorded changes: io slots have fixed VRAM buffers, and the bound host array
        is copied in at submit() (inputs) or out at wait() (outputs)."""

    def submit(self, deadline: float, launches: range | None = None) -> int:
        for slot, b in enumerate(self.blob.inputs):
            self.gpu.upload(self.slots[b.offset][0], self._bound[slot].reshape(-1).view("u1"),
                            deadline)
        self.submitted += 1
        self.gpu.launch(pm4.indirect_buffer(self.ib, self.ib_dwords) +
                        pm4.release_mem(self.gpu.window + TIMELINE_AT, self.submitted))
        return self.submitted

    def completed(self) -> int:
        return self.gpu.timeline()

    def wait(self, value: int, deadline: float) -> None:
        wait_until(lambda: self.completed() >= value, deadline, f"amd submission {value}")
        if value > self.done:
            n_in = len(self.blob.inputs)
            for i, b in enumerate(self.blob.outputs):
                out = self._bound[n_in + i].reshape(-1).view("u1")
                self.gpu.download(self.slots[b.offset][0], memoryview(out), deadline)
            self.done = value

    def recover(self) -> None:
        self._bring_up(time.monotonic() + LOAD_TIMEOUT_S)

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None
