"""The qcom device (device="qcom"): qcom blobs on the Adreno 630 through KGSL, with no vendor
runtime on the per-run path (runner/device.py's contract v2).

load():   open KGSL (the kernel, or qcom/mock_kgsl.py with KEEL_KGSL=mock), refuse unvalidated
          chips, get the programs (qcom/store.py: the blob's embedded ones when they were
          built for this chip and driver, else built once and cached by chip, driver and source), allocate GPU objects (arena, weights, one per io slot, shaders, a zeroed
          border-colour table, the timeline word, the command ring), create a context and record
          the whole graph into one indirect buffer (qcom/record.py).
submit(): copies inputs bound as unaligned host arrays into their slots, writes three packets
          into the command ring (call the graph, wait for idle, write the timeline value) and
          makes one GPU_COMMAND ioctl. The ring refuses space a pending submission still reads.
wait():   one timestamp wait, in slices bounded by the deadline (Kgsl.wait_until); then checks
          the timeline word the GPU wrote and copies unaligned outputs out. A context the kernel
          faulted or reset (EDEADLK) is a DeviceError; a timestamp that has not retired by the
          deadline is a DeviceTimeout.
recover(): destroys the context, creates a fresh one, re-records the graph; bindings, io
          buffers and weights survive.

Binding: io_buffer(slot) is the slot's own GPU object, mapped. bind() of another host array
imports it zero-copy when it is whole pages (GPUOBJ_IMPORT) and patches that slot's addresses
in the argument block; any other array is staged through a second object of the slot (copied in
at submit, out at wait), so what was written into io_buffer(slot) stays for later runs. The
argument block is patched in place, so rebinding while a submission is in flight is refused; so
is a second submission while one with staged outputs is pending.
"""
from __future__ import annotations

import os

import numpy as np

from qcom import kgsl, record, store
from qcom.cmdstream import OPCODES, lohi, pkt7
from qcom.ring import Ring
from runner.device import Device
from runner.errors import BlobError, ConfigError, DeviceError, DeviceTimeout

RING_BYTES = 1 << 16  # 64 bytes per submission: a thousand in flight before the ring refuses
PRIORITY_VAR = "KEEL_QCOM_PRIORITY"  # 0 (highest) .. 15; modeld runs where the UI preempts it


def _priority() -> int:
    text = os.environ.get(PRIORITY_VAR, "8")
    if not text.isdigit() or not 0 <= int(text) <= 15:
        raise ConfigError(f"{PRIORITY_VAR}={text!r}: expected a KGSL priority 0..15")
    return int(text)


class QcomDevice(Device):
    name = "qcom"

    def check_target(self, target: str) -> None:
        if target != "qcom":
            raise BlobError(f"device 'qcom' runs target 'qcom' blobs, blob target is {target!r}")

    def load(self, blob) -> None:
        self.kgsl, self.objs, self.ctx = kgsl.Kgsl(), [], None
        self.programs = store.from_blob(blob.manifest["meta"].get(store.EMBED_KEY),
                                          bytes(blob.programs).decode(),
                                          *store.identity(self.kgsl), self.cache_dir)
        missing = sorted({ln.kernel for ln in blob.launches} - set(self.programs))
        if missing:
            raise BlobError(f"launches name kernels {missing} that the program does not define")
        self.blob, self.specs = blob, [*blob.inputs, *blob.outputs]
        if any(b.image for b in self.specs):
            raise BlobError("qcom: an input or output with an image layout; expected plain buffers")
        self._allocate(blob)
        self.value = self.done = 0
        self.pending: dict[int, tuple] = {}  # value -> (timestamp, staged outputs)
        self.ring = Ring(RING_BYTES, lambda v: v <= self.done, "command")
        self.priority = _priority()
        self.ctx = self.kgsl.context_create(self.priority)
        self._record()

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
        self.io_objs, self.io = [], []
        for b in self.specs:
            obj, view = self._obj(b.nbytes, f"io {b.name}")
            self.io_objs.append(obj)
            self.io.append(view[:b.nbytes].view(b.dtype).reshape(b.shape))
        self.addr = [o.gpuaddr for o in self.io_objs]  # what the recording holds per slot
        self.bound: list = list(self.io)
        self.imported: dict[int, kgsl.GpuObj] = {}  # slot -> import of its bound array
        self.external: dict[int, kgsl.GpuObj] = {}  # slot -> GPU memory from bind_device
        self.stages: dict[int, tuple] = {}  # slot -> (GPU object, array) for unaligned arrays
        self.graph = self.args = None

    def _record(self) -> None:
        """The graph into fresh graph and argument objects (re-recorded by recover)."""
        for old in (self.graph, self.args):
            if old is not None:
                self.kgsl.free(old.id)
                self.objs.remove(old)
        self.args, a = self._obj(record.args_bytes(self.blob, self.programs), "arguments")
        layout = record.Layout({"arena": self.arena.gpuaddr, "weights": self.weights.gpuaddr},
                               self.addr, self.shaders, self.args.gpuaddr, self.border.gpuaddr)
        rec = record.record(self.blob, self.programs, layout)
        self.args_words = a.view(np.uint32)
        self.args_words[:len(rec.args)] = rec.args
        self.sites = rec.sites
        self.graph, g = self._obj(4 * len(rec.words), "graph")
        g.view(np.uint32)[:len(rec.words)] = rec.words
        self.graph_dwords = len(rec.words)
        # each submission's ring entry: call the graph, wait for idle, write the timeline value
        self.entry = np.array(
            pkt7(OPCODES["CP_INDIRECT_BUFFER"], *lohi(self.graph.gpuaddr), self.graph_dwords)
            + pkt7(OPCODES["CP_WAIT_FOR_IDLE"])
            + pkt7(OPCODES["CP_MEM_WRITE"], *lohi(self.timeline.gpuaddr), 0), np.uint32)

    # ---- io ------------------------------------------------------------------------------------
    def io_buffer(self, slot: int) -> np.ndarray:
        return self.io[slot]

    def _idle(self, what: str) -> None:
        if self.value > self.done:
            raise DeviceError(f"qcom: {what} while submission {self.value} is in flight; wait "
                              f"for it first (the recorded arguments are patched in place)")

    def _point(self, slot: int, addr: int) -> None:
        if addr != self.addr[slot]:
            for i in self.sites.get(slot, ()):
                self.args_words[i:i + 2] = lohi(addr)
            self.addr[slot] = addr
        old = self.imported.pop(slot, None)
        if old is not None:
            self.kgsl.free(old.id)

    def bind(self, slot: int, array: np.ndarray) -> None:
        if array is self.bound[slot]:
            return
        self._idle(f"binding slot {slot}")
        ptr, n = array.ctypes.data, array.nbytes
        if array is self.io[slot]:
            self._point(slot, self.io_objs[slot].gpuaddr)
        elif n == 0 or ptr % kgsl.PAGE or n % kgsl.PAGE:
            self._point(slot, self._stage(slot)[0].gpuaddr)
        else:
            obj = self.kgsl.import_user(ptr, n)
            self._point(slot, obj.gpuaddr)
            self.imported[slot] = obj
        self.external.pop(slot, None)
        self.bound[slot] = array

    def bind_device(self, slot: int, mem) -> None:
        """`mem`: a kgsl.GpuObj of this device's KGSL (imported or allocated), >= the slot."""
        spec = self.specs[slot]
        if not isinstance(mem, kgsl.GpuObj) or mem.size < spec.nbytes:
            raise DeviceError(f"qcom slot {slot} ({spec.name!r}): bind_device expected a "
                              f"qcom.kgsl.GpuObj of at least {spec.nbytes} bytes, got {mem!r}")
        self._idle(f"binding slot {slot}")
        self._point(slot, mem.gpuaddr)
        self.external[slot] = self.bound[slot] = mem

    def _stage(self, slot: int) -> tuple:
        """The slot's staging object (made on first use), never its io buffer: what a caller
        wrote into io_buffer(slot) must survive runs that bound other arrays."""
        if slot not in self.stages:
            spec = self.specs[slot]
            obj, view = self._obj(spec.nbytes, f"staging for {spec.name}")
            self.stages[slot] = (obj, view[:spec.nbytes].view(spec.dtype).reshape(spec.shape))
        return self.stages[slot]

    def _staged(self, slot: int) -> bool:
        a = self.bound[slot]
        return slot not in self.external and slot not in self.imported and a is not self.io[slot]

    # ---- runs ----------------------------------------------------------------------------------
    def submit(self, deadline: float, launches: range | None = None) -> int:
        if any(outs for _, outs in self.pending.values()):
            raise DeviceError("qcom: a submission with staged outputs has not been waited for; "
                              "its outputs would be overwritten")
        for slot, b in enumerate(self.blob.inputs):
            if self._staged(slot):
                np.copyto(self.stages[slot][1], self.bound[slot])
        value, n = self.value + 1, len(self.entry)
        at = self.ring.alloc(4 * n, value)
        self.ring_words[at // 4:at // 4 + n] = self.entry
        self.ring_words[at // 4 + n - 1] = value
        ts = self.kgsl.submit(self.ctx, [(self.ring_obj.gpuaddr + at, 4 * n)])
        n_in = len(self.blob.inputs)
        self.pending[value] = (ts, [s for s in range(n_in, len(self.specs)) if self._staged(s)])
        self.value = value
        return value

    def wait(self, value: int, deadline: float) -> None:
        if value <= self.done:
            return
        ts = self.pending[value][0]
        if not self.kgsl.wait_until(self.ctx, ts, deadline):
            raise DeviceTimeout(f"qcom submission {value} (KGSL timestamp {ts} of context "
                                f"{self.ctx}) not retired by its deadline")
        self._retire(value)

    def completed(self) -> int:
        """Polls the retired timestamp (no wait); DeviceError when the context faulted."""
        if self.pending:
            retired = self.kgsl.read_timestamp(self.ctx)
            done = [v for v, (ts, _) in self.pending.items() if kgsl.ts_reached(retired, ts)]
            if done:
                self._retire(max(done))
        return self.done

    def _retire(self, value: int) -> None:
        """Submission `value` (and every earlier one) retired: check the timeline word the GPU
        writes last, copy staged outputs out."""
        if self.timeline_word[0] < value:  # the ring entry did not run to its end
            raise DeviceError(f"qcom submission {value} retired, but the timeline word the GPU "
                              f"writes last holds {int(self.timeline_word[0])}")
        for v in sorted(v for v in self.pending if v <= value):
            for slot in self.pending.pop(v)[1]:
                np.copyto(self.bound[slot], self.stages[slot][1])
        self.done = value

    def recover(self) -> None:
        """A fresh context and a re-recorded graph; what was in flight is abandoned."""
        try:
            self.kgsl.context_destroy(self.ctx)
        except DeviceError:
            pass  # a context the kernel already tore down: nothing left to destroy
        self.ctx = None
        self.pending.clear()
        self.done = self.value
        self.ring.reset()
        self.ctx = self.kgsl.context_create(self.priority)
        self._record()

    def close(self) -> None:
        k = getattr(self, "kgsl", None)
        if k is None or k.fd is None:
            return
        try:
            if self.ctx is not None:
                k.context_destroy(self.ctx)
            for obj in [*getattr(self, "imported", {}).values(), *self.objs]:
                k.free(obj.id)
        except DeviceError:
            pass  # closing a lost device: the kernel frees what the fd held
        finally:
            self.objs, self.imported = [], {}
            k.close()

    def __del__(self):
        self.close()
