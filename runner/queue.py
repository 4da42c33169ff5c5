"""The generic queue device: the half of runner/device.py's contract that is the same on every
backend, written once. A backend (cpu, mock, opencl, qcom, dsp, amd) subclasses QueueDevice and
supplies only its hardware verbs (listed on the class); this module owns:

  * binding: each io slot is bound to its own io memory, to mapped host memory (zero-copy), to
    memory the caller already has on the device (bind_device) or to state memory (bind_states:
    a half of a state, or a ring's window or rows, `state_part`). A binding that changes the
    slot's address patches that slot's recorded addresses (the backend's `patch`) and nothing
    else; rebinding the bound array is free.
    Patching while a submission is in flight is refused: the recording is patched in place.
    `binds` counts the bindings that changed: a caller that saw it unchanged since its own
    binding knows every slot is still bound as it left it (runner/model.py skips rebinding).
  * staging, at one moment each: a host array the device cannot map is bound through the slot's
    staging memory; inputs are copied in by submit(), before the kick; outputs are copied out by
    wait(), once it has seen the submission complete; only the slots the submitted launch range
    touches (another entry's staged slots would cross a USB link for nothing). The caller keeps
    the arrays untouched in between (the contract's rule for every binding). Submissions in
    flight together share their bindings (rebinding waits for them) and their inputs, so they
    compute the same outputs: the staged outputs of a submission not yet waited for are copied
    out with the next one's.
  * the deadline wait: wait() is runner/device.py's wait_until over `completed`, sleeping in the
    backend's `block`.
  * recovery: recover() calls the backend's `reset`, then drops what was in flight; bindings,
    io memory, state and weights survive.
  * profiling: profile(on) and spans() keep the submitted launch range and refuse spans() before
    a profiled submission completed; the backend reads its own timestamps (`launch_times`).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from runner.device import Device, Span, wait_until
from runner.errors import DeviceError
from runner.graph import Graph


STAMP_BYTES = 16  # per launch: the counter before it and after it, u64 little-endian each


class Memory(NamedTuple):
    """Device memory: its address as the backend patches it (a pointer, a GPU address, a buffer
    offset, a cl_mem), a host view of it (uint8) or None where it is not host-visible, and its
    size."""
    address: object
    view: np.ndarray | None
    nbytes: int


class QueueDevice(Device):
    """Backend verbs (each subclass implements these and nothing of the generic half):
      open(blob)                 allocate and fill arena, weights, programs (load time)
      alloc(nbytes) -> Memory    device memory, zero-filled
      map_host(slot, array)      a zero-copy address of host memory for slot, or None (staged)
      device_address(slot, mem)  the address of memory bind_device was given, checked
      record()                   record the graph (self.graph) into the command format, io
                                 slots at self.io_address[slot]
      patch(slot, address)       rewrite the slot's recorded addresses (graph.sites[slot])
      kick(launches, deadline, value)   start submission `value` (timeline value) of the
                                 launch range; `deadline` bounds it where it runs inside
      completed(), block(s)      the contract's (runner/device.py)
      reset()                    abandon what is in flight, make the queue usable again
      upload(mem, data), download(mem) -> bytes   for memory without a host view (whole)
      set_profiling(on)          (optional) from the next kick on, time every launch: with
                                 `tick_ns` set, record streams that write the counter into
                                 `stamps` (STAMP_BYTES per launch); else its own way, read by
      launch_times(launches)     spans of the last profiled submission
    """
    staged_by_copy = False  # the io memory is not host-visible: io_buffer is a host array
    tick_ns = 0.0  # the period of the counter a recording writes around launches (0: none)

    def load(self, blob) -> None:
        self.graph = Graph(blob)
        self.value = self.retired = 0
        self.pending: dict[int, list] = {}  # value -> [(slot, output array, staging)], if any
        self.profiled: range | None = None
        self.profiling = False
        self.stamps: Memory | None = None  # (start, end) counters per launch, once profiled
        self.open(blob)
        self.io_memory = [self.alloc(b.nbytes) for b in self.graph.io]
        self.io_arrays = [self._host_array(m, b) for m, b in zip(self.io_memory, self.graph.io)]
        self.io_address = [m.address for m in self.io_memory]
        self.bound: list = list(self.io_arrays)
        self.binds = 0  # bindings changed so far
        self.stages: dict[int, Memory] = {}  # slot -> its staging memory, made on first use
        self.typed: dict[tuple, np.ndarray] = {}  # (slot, id(memory)) -> _typed's view
        self.staged: set[int] = {s for s in range(len(self.graph.io)) if self.staged_by_copy}
        self.used: dict[range, frozenset[int]] = {}  # launch range -> the io slots it touches
        self.record()

    def _host_array(self, mem: Memory, spec) -> np.ndarray:
        if mem.view is None:  # the host side of a slot the device copies in and out
            return np.zeros(spec.shape, spec.dtype)
        return mem.view[:spec.nbytes].view(spec.dtype).reshape(spec.shape)

    # ---- binding -----------------------------------------------------------------------------
    def io_buffer(self, slot: int) -> np.ndarray:
        return self.io_arrays[slot]

    def bind(self, slot: int, array: np.ndarray) -> None:
        if array is self.bound[slot]:
            return
        if self.value > self.retired:
            self._idle(slot)  # raises
        own = array is self.io_arrays[slot]
        mapped = None if own else self.map_host(slot, array)
        if mapped is not None:  # zero-copy: the recording points at the array itself
            address, staged = mapped, False
        elif own or self.staged_by_copy:  # the slot's own memory (not host-visible: copied
            address, staged = self.io_memory[slot].address, self.staged_by_copy  # to and from)
        else:  # host-visible, but not this array: copied through the slot's staging memory
            address, staged = self._stage(slot).address, True
        self._point(slot, address)
        if staged:
            self.staged.add(slot)
        elif self.staged:
            self.staged.discard(slot)
        self.bound[slot] = array
        self.binds += 1

    def bind_device(self, slot: int, mem) -> None:
        address = self.device_address(slot, mem)
        self._idle(slot)
        self._point(slot, address)
        self.staged.discard(slot)
        self.bound[slot] = mem
        self.binds += 1

    def bind_states(self, binds: list[tuple[int, Memory]]) -> None:
        bound, io_address, changed = self.bound, self.io_address, False
        for slot, mem in binds:
            if mem is not bound[slot]:
                if not changed:
                    self._idle(slot)
                    changed = True
                if mem.address != io_address[slot]:
                    self.patch(slot, mem.address)
                    io_address[slot] = mem.address
                self.staged.discard(slot)
                bound[slot] = mem
        self.binds += changed

    def _idle(self, slot: int) -> None:
        if self.value > self.retired:
            raise DeviceError(f"{self.name}: binding slot {slot} while submission {self.value} "
                              f"is in flight; wait for it first (the recording is patched in "
                              f"place)")

    def _point(self, slot: int, address) -> None:
        if address is self.io_address[slot] or address == self.io_address[slot]:
            return
        self.patch(slot, address)
        self.io_address[slot] = address

    def _stage(self, slot: int) -> Memory:
        """The slot's staging memory, never its io memory: what a caller wrote into
        io_buffer(slot) stays for later runs that bind it again."""
        if slot not in self.stages:
            self.stages[slot] = self.alloc(self.graph.io[slot].nbytes)
        return self.stages[slot]

    def _staging(self, slot: int) -> Memory:
        return self.io_memory[slot] if self.staged_by_copy or self.bound[slot] is \
            self.io_arrays[slot] else self.stages[slot]

    # ---- state memory ------------------------------------------------------------------------
    def alloc_state(self, nbytes: int) -> Memory:
        return self.alloc(nbytes)

    def state_part(self, mem: Memory, offset: int, nbytes: int) -> Memory:
        view = None if mem.view is None else mem.view[offset:offset + nbytes]
        return Memory(mem.address + offset, view, nbytes)

    def state_view(self, mem: Memory) -> np.ndarray | None:
        return mem.view

    def read_state(self, mem: Memory) -> bytes:
        return mem.view.tobytes() if mem.view is not None else self.download(mem)

    def write_state(self, mem: Memory, data: bytes) -> None:
        if mem.view is not None:
            mem.view[:len(data)] = np.frombuffer(data, np.uint8)
        else:
            self.upload(mem, data)

    # ---- runs --------------------------------------------------------------------------------
    def submit(self, deadline: float, launches: range | None = None) -> int:
        if self.pending:
            self.pending.clear()  # superseded: the same outputs arrive with this one (see above)
        launches = range(len(self.graph.launches)) if launches is None else launches
        outs = self._copy_in_staged(launches) if self.staged else None
        if self.profiling and self.tick_ns:
            self._clear_stamps()
        self.kick(launches, deadline, self.value + 1)
        self.value += 1
        if outs:
            self.pending[self.value] = [(slot, self.bound[slot], self._staging(slot))
                                        for slot in outs]
        if self.profiling:
            self.profiled = launches
        return self.value

    def _copy_in_staged(self, launches: range) -> list[int]:
        """Copy the staged inputs the launches read in; the staged outputs' slots they write, to
        copy out at wait(). Not another entry's slots: they would cross a USB link for nothing."""
        outs = []
        for slot in self.staged & self._uses(launches):
            if slot < self.graph.n_inputs:
                self._copy_in(slot)
            else:
                outs.append(slot)
        return outs

    def _uses(self, launches: range) -> frozenset[int]:
        used = self.used.get(launches)
        if used is None:
            used = self.used[launches] = frozenset(
                slot for slot, sites in self.graph.sites.items()
                if any(i in launches for i, _ in sites))
        return used

    def _copy_in(self, slot: int) -> None:
        mem, arr = self._staging(slot), self.bound[slot]
        if mem.view is not None:
            np.copyto(self._typed(slot, mem), arr)
        else:
            self.upload(mem, arr.reshape(-1).view(np.uint8))

    def _typed(self, slot: int, mem: Memory) -> np.ndarray:
        """Host-visible memory of a slot as the slot's array (made once per memory)."""
        key = (slot, id(mem))
        view = self.typed.get(key)
        if view is None:
            spec = self.graph.io[slot]
            view = self.typed[key] = mem.view[:spec.nbytes].view(spec.dtype).reshape(spec.shape)
        return view

    def wait(self, value: int, deadline: float) -> None:
        if self.completed() < value:
            wait_until(lambda: self.completed() >= value, deadline,
                       f"{self.name} submission {value}", sleep=self.block)
        if self.pending:
            self._retire(value)
        if value > self.retired:
            self.retired = value

    def _retire(self, value: int) -> None:
        """Copy out the staged outputs of every submission up to `value` (complete)."""
        for v in sorted(v for v in self.pending if v <= value):
            for slot, arr, mem in self.pending.pop(v):
                if mem.view is not None:
                    np.copyto(arr, self._typed(slot, mem))
                else:
                    arr.reshape(-1).view(np.uint8)[:] = np.frombuffer(self.download(mem),
                                                                      np.uint8)[:arr.nbytes]

    def recover(self) -> None:
        self.reset()
        self.pending.clear()
        self.retired = self.value

    # ---- profiling ---------------------------------------------------------------------------
    def profile(self, on: bool) -> None:
        if self.value > self.retired:  # qcom and amd record their profiled streams now
            raise DeviceError(f"{self.name}: profile() while submission {self.value} is in "
                              f"flight; wait for it first")
        if on and self.tick_ns and self.stamps is None:  # before the backend records with it
            self.stamps = self.alloc(STAMP_BYTES * max(len(self.graph.launches), 1))
        self.set_profiling(on)
        self.profiling, self.profiled = on, None

    def spans(self) -> list[Span]:
        if self.profiled is None or self.retired < self.value:
            raise DeviceError("spans(): no profiled submission has completed; call "
                              "profile(True) and run first")
        if self.tick_ns:
            return self._stamped_spans(self.profiled)
        return self.launch_times(self.profiled)

    def set_profiling(self, on: bool) -> None:
        raise DeviceError(f"device {self.name!r} has no per-launch timestamps")

    def _clear_stamps(self) -> None:
        """Before a profiled submission: a stamp the device did not write reads as 0."""
        if self.stamps.view is not None:
            self.stamps.view[:] = 0
        else:
            self.upload(self.stamps, bytes(self.stamps.nbytes))

    def _stamped_spans(self, launches: range) -> list[Span]:
        """The (start, end) counter pairs the recording wrote around each launch, as Spans on
        lane 0 from the first start. The launches ran one after another, so the stamps only
        grow: one that does not (0: never written) is a DeviceError naming the launch."""
        raw = self.stamps.view if self.stamps.view is not None else \
            np.frombuffer(self.download(self.stamps), np.uint8)
        ticks = raw[:self.stamps.nbytes].view("<u8").reshape(-1, 2)
        spans, base = [], int(ticks[launches[0], 0]) if len(launches) else 0
        last = base
        for i in launches:
            start, end = int(ticks[i, 0]), int(ticks[i, 1])
            if not start or not last <= start <= end:
                raise DeviceError(f"{self.name}: launch {i}'s timestamps {start}..{end} do not "
                                  f"follow the previous launch's end {last}: not written, or "
                                  f"not in order")
            spans.append(Span(i, 0, round((start - base) * self.tick_ns),
                              round((end - base) * self.tick_ns)))
            last = end
        return spans
