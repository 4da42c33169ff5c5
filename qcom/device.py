"""The qcom device (device="qcom"): qcom blobs on the Adreno 630 through KGSL, with no vendor
runtime on the per-run path. It is runner/queue.py's queue device; this file is its verbs.

open():   open KGSL (the kernel, or sim/qcom/mock_kgsl.py with KEEL_KGSL=mock), refuse unvalidated
          chips, get the programs (qcom/store.py: the blob's embedded ones when they were
          built for this chip and driver, else built once and cached by chip, driver and
          source), allocate GPU objects (arena, weights, shaders, a zeroed border-colour table,
          the timeline word, the command ring) and create a context.
alloc():  a GPU object, mapped: io slots, staging and state memory are all host-visible.
record(): the whole graph into one argument block and one indirect buffer per entry point's
          launch range (qcom/record.py).
kick():   three packets into the command ring (call the range's indirect buffer, wait for idle,
          write the timeline value) and one GPU_COMMAND ioctl. The ring refuses space a pending
          submission still reads.
completed(), block(): the retired timestamp (read, or waited for in one KGSL wait of at most
          the slice runner/device.py's wait_until asks); then the timeline word the GPU wrote
          last. A context the kernel faulted or reset (EDEADLK) is a DeviceError.
reset():  destroys the context, creates a fresh one, re-records the graph.
set_profiling(): records a second stream per launch range that reads the always-on counter
          (CP_REG_TO_MEM) before and after each launch, each launch alone between waits for
          idle; runner/queue.py turns the stamps into spans.

Binding: map_host imports a host array zero-copy when it is whole pages (GPUOBJ_IMPORT); any
other array is staged by runner/queue.py. patch() rewrites the slot's address in the argument
block (the dwords `sites[slot]`), in place.
"""
from __future__ import annotations

import os

import numpy as np

from qcom import kgsl, record, store, texture
from qcom.cmdstream import ALWAYS_ON_HZ, OPCODES, lohi, pkt7
from qcom.ring import Ring
from runner.dmabuf import DmaBuf
from runner.errors import BlobError, ConfigError, DeviceError, InputError
from runner.format import Region
from runner.queue import Memory, QueueDevice

RING_BYTES = 1 << 16  # 64 bytes per submission: a thousand in flight before the ring refuses
PRIORITY_VAR = "KEEL_QCOM_PRIORITY"  # 0 (highest) .. 15; modeld runs where the UI preempts it


def _priority() -> int:
    text = os.environ.get(PRIORITY_VAR, "8")
    if not text.isdigit() or not 0 <= int(text) <= 15:
        raise ConfigError(f"{PRIORITY_VAR}={text!r}: expected a KGSL priority 0..15")
    return int(text)


class QcomDevice(QueueDevice):
    name = "qcom"
    tick_ns = 1e9 / ALWAYS_ON_HZ  # profiled streams read the always-on counter (runner/queue.py)

    def check_target(self, target: str) -> None:
        if target != "qcom":
            raise BlobError(f"device 'qcom' runs target 'qcom' blobs, blob target is {target!r}")

    def open(self, blob) -> None:
        self.kgsl, self.objs, self.ctx = kgsl.Kgsl(), [], None
        self.programs = store.from_blob(blob.binaries,
                                          bytes(blob.programs).decode(),
                                          *store.identity(self.kgsl), self.cache_dir)
        missing = sorted({ln.kernel for ln in blob.launches} - set(self.programs))
        if missing:
            raise BlobError(f"launches name kernels {missing} that the program does not define")
        self.blob = blob
        if any(b.image for b in blob.outputs):
            raise BlobError("qcom: an output with an image layout; expected plain buffers")
        self._allocate(blob)
        self.done = 0
        self.timestamps: dict[int, int] = {}  # value -> KGSL timestamp, until retired
        self.ring = Ring(RING_BYTES, lambda v: v <= self.done, "command")
        self.priority = _priority()
        self.ctx = self.kgsl.context_create(self.priority)
        self.imported: dict[int, kgsl.GpuObj] = {}  # slot -> import of its bound array
        self.dmabufs: dict[int, kgsl.GpuObj] = {}  # dma-buf fd -> its import (bind_device)
        self.streams: dict[range, tuple] = {}  # launch range -> (GPU object, dwords)

    def _obj(self, nbytes: int, what: str):
        try:
            obj = self.kgsl.alloc(max(nbytes, 1))
        except DeviceError as e:
            raise DeviceError(f"qcom: allocating the {what}: {e}") from None
        self.objs.append(obj)
        view = np.frombuffer(self.kgsl.mmap(obj), np.uint8)
        return obj, view

    def _allocate(self, blob) -> None:
        self.arena, _ = self._obj(blob.arena_bytes, "arena")
        self.weights, w = self._obj(len(blob.weights), "weights")
        w[:len(blob.weights)] = np.frombuffer(blob.weights, np.uint8)
        offsets, size = {}, 0
        for name, p in self.programs.items():
            offsets[name], size = size, size + len(p.binary)
        shaders, s = self._obj(size, "shaders")
        for name, p in self.programs.items():
            s[offsets[name]:offsets[name] + len(p.binary)] = np.frombuffer(p.binary, np.uint8)
        self.shaders = {n: shaders.gpuaddr + o for n, o in offsets.items()}
        self.border, _ = self._obj(64, "border colours")  # zeroed: clamp-to-border reads 0
        self.timeline, t = self._obj(4, "timeline")
        self.timeline_word = t[:4].view(np.uint32)
        self.ring_obj, r = self._obj(RING_BYTES, "command ring")
        self.ring_words = r.view(np.uint32)
        self.args = None

    # ---- verbs (runner/queue.py) --------------------------------------------------------------
    def alloc(self, nbytes: int) -> Memory:
        obj, view = self._obj(nbytes, f"{nbytes} bytes of io or state memory")
        return Memory(obj.gpuaddr, view[:nbytes], nbytes)

    def map_host(self, slot: int, array):
        ptr, n = array.ctypes.data, array.nbytes
        if n == 0 or ptr % kgsl.PAGE or n % kgsl.PAGE:
            return None
        self._free_import(slot)
        self.imported[slot] = obj = self.kgsl.import_user(ptr, n)
        return obj.gpuaddr

    def _free_import(self, slot: int) -> None:
        old = self.imported.pop(slot, None)
        if old is not None:
            self.kgsl.free(old.id)

    def device_address(self, slot: int, mem) -> int:
        """`mem`: a kgsl.GpuObj of this device's KGSL (imported or allocated), >= the slot, or a
        runner DmaBuf (a camera buffer), imported on first use and kept until close."""
        spec = self.graph.io[slot]
        if isinstance(mem, DmaBuf):
            return self._dmabuf(mem).gpuaddr + mem.offset
        if not isinstance(mem, kgsl.GpuObj) or mem.size < spec.nbytes:
            raise DeviceError(f"qcom slot {slot} ({spec.name!r}): bind_device expected a "
                              f"qcom.kgsl.GpuObj of at least {spec.nbytes} bytes, got {mem!r}")
        return mem.gpuaddr

    def _dmabuf(self, buf: DmaBuf) -> kgsl.GpuObj:
        """The import of `buf`'s dma-buf: one per fd for the device's life, since VisionIPC
        cycles through a few buffers that it keeps for as long as the camera runs."""
        obj = self.dmabufs.get(buf.fd)
        if obj is None:
            obj = self.dmabufs[buf.fd] = self.kgsl.import_dmabuf(buf.fd)
        if buf.offset + buf.nbytes > obj.size:
            raise InputError(f"qcom: DmaBuf of fd {buf.fd}: bytes {buf.offset}.."
                             f"{buf.offset + buf.nbytes} lie outside its {obj.size}-byte buffer")
        return obj

    def record(self) -> None:
        """The graph into fresh argument and stream objects (re-recorded by reset)."""
        for old in [self.args, *(obj for obj, _ in self.streams.values())]:
            if old is not None:
                self.kgsl.free(old.id)
                self.objs.remove(old)
        self.args, a = self._obj(record.args_bytes(self.blob, self.programs), "arguments")
        layout = record.Layout({Region.ARENA: self.arena.gpuaddr,
                                Region.WEIGHTS: self.weights.gpuaddr},
                               list(self.io_address), self.shaders, self.args.gpuaddr,
                               self.border.gpuaddr)
        rec = record.record(self.blob, self.programs, layout)
        self.args_words = a.view(np.uint32)
        self.args_words[:len(rec.args)] = rec.args
        self.words = memoryview(a).cast("I")  # patch()'s writes: a numpy slice per site is slow
        self.sites = {slot: [rec.at[site] for site in sites]
                      for slot, sites in self.graph.sites.items()}
        # per slot, the dwords of its 64-bit pointers and those of its image descriptors
        self.pointers = {s: [i for i in d if i not in rec.textures] for s, d in self.sites.items()}
        self.images = {s: [i for i in d if i in rec.textures] for s, d in self.sites.items()}
        ranges = {range(len(self.blob.launches))} | {e.launches for e in self.graph.entries}
        stamps = None if self.stamps is None else self.stamps.address
        self.streams = {}  # (launch range, profiled) -> (GPU object, dwords)
        for launches in ranges:
            for at in {None, stamps}:  # profiled: the always-on counter around each launch
                words = record.stream(rec, launches, at)
                obj, g = self._obj(4 * len(words), "graph")
                g.view(np.uint32)[:len(words)] = words
                self.streams[launches, at is not None] = (obj, len(words))
        # each submission's ring entry, the timeline value left to write: call the range's
        # stream, wait for idle, write the timeline value
        self.ring_entries = {key: np.array(
            pkt7(OPCODES["CP_INDIRECT_BUFFER"], *lohi(obj.gpuaddr), n)
            + pkt7(OPCODES["CP_WAIT_FOR_IDLE"])
            + pkt7(OPCODES["CP_MEM_WRITE"], *lohi(self.timeline.gpuaddr), 0), np.uint32)
            for key, (obj, n) in self.streams.items()}

    def patch(self, slot: int, address: int) -> None:
        images = self.images.get(slot)
        if images and address % texture.BASE_ALIGN:
            spec = self.graph.io[slot]
            raise InputError(f"qcom slot {slot} ({spec.name!r}): kernels read it as an image, "
                             f"whose base must be {texture.BASE_ALIGN}-byte aligned; got GPU "
                             f"address {address:#x}")
        words, lo, hi = self.words, address & 0xFFFFFFFF, address >> 32
        for i in self.pointers.get(slot, ()):
            words[i], words[i + 1] = lo, hi
        for i in images or ():
            texture.set_base(self.args_words, i, address)
        if slot in self.imported and self.imported[slot].gpuaddr != address:
            self._free_import(slot)

    def set_profiling(self, on: bool) -> None:
        """Profiled streams read CP_ALWAYS_ON_COUNTER into `stamps` around each launch; they
        are recorded beside the plain ones the first time (kick picks by self.profiling)."""
        if on and (range(len(self.blob.launches)), True) not in self.streams:
            self.record()

    def kick(self, launches: range, deadline: float, value: int) -> None:
        entry = self.ring_entries[launches, self.profiling]
        n = len(entry)
        at = self.ring.alloc(4 * n, value) // 4
        self.ring_words[at:at + n] = entry
        self.ring_words[at + n - 1] = value
        self.timestamps[value] = self.kgsl.submit(self.ctx, [(self.ring_obj.gpuaddr + 4 * at,
                                                               4 * n)])

    def completed(self) -> int:
        """Polls the retired timestamp (no wait); DeviceError when the context faulted or a
        retired submission did not run to its end."""
        if self.timestamps:
            retired = self.kgsl.read_timestamp(self.ctx)
            done = [v for v, ts in self.timestamps.items() if kgsl.ts_reached(retired, ts)]
            if done:
                value = max(done)
                if self.timeline_word[0] < value:  # the ring entry did not run to its end:
                    self.kgsl.wait(self.ctx, self.timestamps[value], 1)  # EDEADLK says why
                    raise DeviceError(f"qcom submission {value} retired, but the timeline word "
                                      f"the GPU writes last holds {int(self.timeline_word[0])}")
                for v in done:
                    del self.timestamps[v]
                self.done = max(self.done, value)
        return self.done

    def block(self, seconds: float) -> None:
        """One KGSL wait for the latest submission, of at most `seconds` (whole ms)."""
        if self.timestamps:
            ts = self.timestamps[max(self.timestamps)]
            self.kgsl.wait(self.ctx, ts, max(1, int(seconds * 1000)))

    def reset(self) -> None:
        """A fresh context and a re-recorded graph; what was in flight is abandoned."""
        try:
            self.kgsl.context_destroy(self.ctx)
        except DeviceError:
            pass  # a context the kernel already tore down: nothing left to destroy
        self.ctx = None
        self.timestamps.clear()
        self.done = self.value
        self.ring.reset()
        self.ctx = self.kgsl.context_create(self.priority)
        self.record()

    def close(self) -> None:
        k = getattr(self, "kgsl", None)
        if k is None or k.fd is None:
            return
        try:
            if self.ctx is not None:
                k.context_destroy(self.ctx)
            for obj in [*getattr(self, "imported", {}).values(),
                        *getattr(self, "dmabufs", {}).values(), *self.objs]:
                k.free(obj.id)
        except DeviceError:
            pass  # closing a lost device: the kernel frees what the fd held
        finally:
            self.objs, self.imported, self.dmabufs = [], {}, {}
            k.close()

    def __del__(self):
        self.close()
