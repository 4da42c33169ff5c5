"""OpenCL device: runs "opencl" (and "qcom") blobs on any OpenCL 1.2 platform through the ICD
loader (libOpenCL; its binding is runner/cl.py), with no compiler and no pyopencl.

The programs section is one OpenCL C source holding every kernel; the buffer table says which
buffers kernels read as images (docs/blob.md).

Guarantees (beyond runner/device.py's contract):
  * load() builds the program once per (device, driver, source) and caches the device binary in
    `cache_dir` (beside the blob; not on PoCL, which caches kernels itself); a stale or unreadable
    cache entry is rebuilt from source. A build failure raises BlobError with the build log and
    the kernel it points at. load() then runs the graph once, so drivers that compile kernels at
    their first enqueue (PoCL) do it inside load, not inside the first run's deadline.
  * every tensor is a sub-buffer of the arena or weights buffer (offsets are aligned by the
    compiler to the target's buffer_align); io slots are device buffers written/read per run.
  * io slots are device buffers; io_buffer(slot) is a host array, and a bound host array is
    written to the slot's buffer by submit() and read back by wait() (runner/queue.py: staging).
    bind_device() patches the kernels to a cl_mem of this context and copies nothing. submit()
    enqueues the launches on one in-order queue, then a marker, and flushes; the timeline polls
    each marker's event, so wait() never blocks in the driver. A negative event status or a
    failed call is a DeviceError; recover() drains the queue and replaces it.
  * faults (tests): KEEL_OPENCL_FAULTS's hang@N and slow@N:MS (runner/faults.py) hold submission
    N behind a user event the driver opens only at recover() or MS late; fault@N has the driver
    refuse its completion marker (_gate).
  * image buffers: with cl_khr_image2d_from_buffer the image aliases the buffer (zero copy, the
    Adreno path, hence the pitched rows); without it (PoCL) the image is its own allocation of
    `pitch` texels per row, filled by a buffer-to-image copy after the kernel that writes it
    (weights: once, at load). An input read as an R8 image (a camera frame, qcom blobs) aliases
    the slot's bound cl_mem the same way, re-made when the slot is rebound; without the
    extension its image is refreshed by a copy from the slot before each launch that reads it.
"""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from runner import cache, cl
from runner.cl import (BUILD_OPTIONS, CL_BUFFER_CREATE_TYPE_REGION, CL_COMPLETE,
                       CL_DEVICE_EXTENSIONS, CL_DEVICE_IMAGE2D_MAX_HEIGHT,
                       CL_DEVICE_IMAGE2D_MAX_WIDTH, CL_DEVICE_IMAGE_BASE_ADDRESS_ALIGNMENT,
                       CL_DEVICE_IMAGE_PITCH_ALIGNMENT, CL_DEVICE_MEM_BASE_ADDR_ALIGN,
                       CL_DEVICE_NAME, CL_DEVICE_VERSION, CL_DRIVER_VERSION,
                       CL_EVENT_COMMAND_EXECUTION_STATUS, CL_MEM_COPY_HOST_PTR,
                       CL_MEM_CONTEXT, CL_MEM_OBJECT_IMAGE2D, CL_MEM_READ_ONLY,
                       CL_MEM_READ_WRITE, CL_MEM_SIZE,
                       CL_PLATFORM_NAME, CL_PLATFORM_VERSION, CL_PROFILING_COMMAND_END,
                       CL_PROFILING_COMMAND_START, CL_QUEUE_PROFILING_ENABLE,
                       CL_SUCCESS, IMAGE_FORMATS,
                       INSTALL_HINT, check, create, ffi, info_str, info_uint, platform_devices,
                       unavailable_reason)
from runner.device import Span
from runner.errors import BlobError, DeviceError
from runner.faults import listed
from runner.format import DEVICE_REGIONS, Region
from runner.graph import Kind
from runner.queue import Memory, QueueDevice

__all__ = ["OpenCLDevice", "unavailable_reason"]

REFUSED = ffi.new("cl_event[]", [ffi.NULL])  # fault@N: a wait list the driver must refuse

class OpenCLDevice(QueueDevice):
    name = "opencl"
    runs = ("opencl", "qcom")  # both render OpenCL C; qcom blobs use Adreno limits
    staged_by_copy = True  # io memory is cl_mem: bound host arrays are written and read per run

    def __init__(self):
        self.gates: list = []  # the user events of faulted submissions, until reset or close
        self.timers: list[threading.Timer] = []  # slow: what opens a gate late
        self.faults = listed(self.name)  # KEEL_OPENCL_FAULTS, injected through the driver
        self.kicks = 0  # submissions attempted: a refused one (fault) consumes no timeline value
        lib = cl.lib()
        pairs = platform_devices()
        if not pairs:
            raise BlobError(f"no OpenCL platform with a device found; install one "
                            f"({INSTALL_HINT})")
        self.platform, self.dev = pairs[0]
        self.lib = lib
        self.device_name = info_str(lib.clGetDeviceInfo, self.dev, CL_DEVICE_NAME)
        self.driver = " ".join(info_str(fn, obj, p) for fn, obj, p in (
            (lib.clGetPlatformInfo, self.platform, CL_PLATFORM_VERSION),
            (lib.clGetDeviceInfo, self.dev, CL_DEVICE_VERSION),
            (lib.clGetDeviceInfo, self.dev, CL_DRIVER_VERSION)))
        self.base_align = info_uint(lib.clGetDeviceInfo, self.dev,
                                     CL_DEVICE_MEM_BASE_ADDR_ALIGN) // 8
        self.extensions = set(info_str(lib.clGetDeviceInfo, self.dev,
                                        CL_DEVICE_EXTENSIONS).split())
        devs = ffi.new("cl_device_id[]", [self.dev])
        self.ctx = ffi.gc(create(lib.clCreateContext, "clCreateContext", ffi.NULL, 1, devs,
                               ffi.NULL, ffi.NULL), lib.clReleaseContext)
        self.events = None  # profiling: one event per launch of the last submission
        self.queue = self._new_queue()
        self.cache_dir = None
        self.inflight: list[tuple[int, object]] = []  # (value, its last event), oldest first
        self.done = 0
        # PoCL caches its compiled kernels itself (~/.cache/pocl), and asking it for a program
        # binary compiles every kernel a second time (for a generic work-group size), doubling
        # the first load; elsewhere (Adreno: seconds per build) the binary cache is the win.
        platform = info_str(lib.clGetPlatformInfo, self.platform, CL_PLATFORM_NAME)
        self.cache_binaries = platform != "Portable Computing Language"

    # ---- verbs (runner/queue.py) --------------------------------------------------------------
    def check_target(self, target: str) -> None:
        if target not in self.runs:
            raise BlobError(f"device 'opencl' runs targets {list(self.runs)}, blob target is "
                            f"{target!r}")

    def open(self, blob) -> None:
        self.arena = self._buffer(CL_MEM_READ_WRITE, blob.arena_bytes)
        self._upload(blob.weights)
        self.program, self.cache = self._program(bytes(blob.programs))
        self.buffers = buffers = blob.buffers
        self.mems = {b.id: self._tensor(b) for b in buffers.values()
                     if b.region in DEVICE_REGIONS}
        parents = {Region.ARENA: self.arena, Region.WEIGHTS: self.weights}
        self.images = {b.id: self._image(b, self.mems[b.id], parents[b.region], b.offset)
                       for b in buffers.values() if b.image and b.region in parents}
        self.frames: dict[int, _Image] = {}  # io slot -> the image an input is read through
        for bid, img in self.images.items():  # weights: filled once, here
            if img.copy is not None and buffers[bid].region is Region.WEIGHTS:
                self._copy_to_image(img)
        check(self.lib.clFinish(self.queue), "clFinish")

    def record(self) -> None:
        """Every launch's kernel with its arguments set; then the whole graph once (on whatever
        the buffers hold): drivers that compile each kernel at its first enqueue (PoCL) do it
        now, not inside the first run()'s deadline."""
        self.kernels, self.commands = [], []
        for ln, args in zip(self.graph.launches, self.graph.bindings):
            kernel, cmds = self._launch_commands(ln, args)
            self.kernels.append(kernel)
            self.commands.append(cmds)
        self._enqueue(range(len(self.commands)))
        check(self.lib.clFinish(self.queue), "clFinish (warm-up run)")
        if self.cache is not None:
            self._save_binary(self.program, self.cache)

    def _launch_commands(self, ln, args) -> tuple:
        """One launch as queue commands: the kernel with its args set, then the image copy of
        its output where the image does not alias the buffer."""
        kernel = ffi.gc(create(self.lib.clCreateKernel, f"clCreateKernel({ln.kernel})",
                               self.program, ln.kernel.encode()), self.lib.clReleaseKernel)
        before = []  # frame copies, where the image does not alias the slot
        for i, (bid, binding) in enumerate(zip(ln.args, args)):
            if binding.kind is Kind.IO and self.graph.io[binding.at].image is not None:
                frame = self._frame(binding.at, self.io_address[binding.at])
                before += [frame] if frame.copy is not None else []
                mem = frame.mem
            elif binding.kind is Kind.IO:
                mem = self.io_address[binding.at]
            else:
                mem = self.images[bid].mem if i > 0 and bid in self.images else self.mems[bid]
            self._set_arg(kernel, i, mem)
        gs = ffi.new("size_t[]", list(ln.global_size))
        ls = ffi.NULL if ln.local_size is None else ffi.new("size_t[]", list(ln.local_size))
        image = self.images.get(ln.args[0])
        return kernel, before + [(kernel, len(ln.global_size), gs, ls, ln.kernel)] + \
            ([image] if image is not None and image.copy is not None else [])

    def alloc(self, nbytes: int) -> Memory:
        zeros = ffi.new("char[]", max(nbytes, 1))
        mem = ffi.gc(create(self.lib.clCreateBuffer, "clCreateBuffer", self.ctx,
                            CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, max(nbytes, 1), zeros),
                     self.lib.clReleaseMemObject)
        return Memory(mem, None, nbytes)

    def map_host(self, slot: int, array):
        return None

    def state_part(self, mem: Memory, offset: int, nbytes: int) -> Memory:
        return Memory(self._sub(mem.address, offset, nbytes, CL_MEM_READ_WRITE,
                                "state memory part"), None, nbytes)

    def upload(self, mem: Memory, data) -> None:
        if mem.nbytes:
            check(self.lib.clEnqueueWriteBuffer(self.queue, mem.address, 1, 0, mem.nbytes,
                                                ffi.from_buffer(data), 0, ffi.NULL, ffi.NULL),
                  "clEnqueueWriteBuffer")

    def download(self, mem: Memory) -> bytes:
        out = bytearray(mem.nbytes)
        if mem.nbytes:
            check(self.lib.clEnqueueReadBuffer(self.queue, mem.address, 1, 0, mem.nbytes,
                                               ffi.from_buffer(out), 0, ffi.NULL, ffi.NULL),
                  "clEnqueueReadBuffer")
        return bytes(out)

    def _upload(self, weights: memoryview) -> None:
        if len(weights) == 0:
            self.weights = self._buffer(CL_MEM_READ_ONLY, 0)
            return
        host = ffi.from_buffer("char[]", weights)
        self.weights = ffi.gc(create(self.lib.clCreateBuffer, "clCreateBuffer (weights)",
                                     self.ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR,
                                     len(weights), host), self.lib.clReleaseMemObject)

    def _set_arg(self, kernel, i: int, mem) -> None:
        check(self.lib.clSetKernelArg(kernel, i, ffi.sizeof("cl_mem"), ffi.new("cl_mem *", mem)),
              f"clSetKernelArg({i})")

    def patch(self, slot: int, mem) -> None:
        if self.graph.io[slot].image is not None:
            mem = self._frame(slot, mem).mem
        for i, j in self.graph.sites.get(slot, ()):
            self._set_arg(self.kernels[i], j, mem)

    def _frame(self, slot: int, source) -> "_Image":
        """The R8 image kernels read input slot `slot` through, over its memory `source`: an
        alias of it, or an image of its own whose copy (the frame's bytes) now reads `source`."""
        img = self.frames.get(slot)
        if img is not None and img.copy is not None:
            img.copy = (source, *img.copy[1:])
        else:
            img = self.frames[slot] = self._image(self.graph.io[slot], source, source, 0)
        return img

    def device_address(self, slot: int, mem):
        """A cl_mem of this device's context, at least the slot's size: kernels use it directly
        and the submission copies nothing for this slot."""
        spec = self.graph.io[slot]
        if not (isinstance(mem, ffi.CData) and ffi.typeof(mem) is ffi.typeof("cl_mem")):
            raise DeviceError(f"opencl slot {slot} ({spec.name!r}): bind_device expected a "
                              f"cl_mem, got {type(mem).__name__}")
        size, ctx = ffi.new("size_t *"), ffi.new("cl_context *")
        check(self.lib.clGetMemObjectInfo(mem, CL_MEM_SIZE, ffi.sizeof("size_t"), size,
                                          ffi.NULL), "clGetMemObjectInfo")
        check(self.lib.clGetMemObjectInfo(mem, CL_MEM_CONTEXT, ffi.sizeof("cl_context"), ctx,
                                          ffi.NULL), "clGetMemObjectInfo")
        if ctx[0] != self.ctx or size[0] < spec.nbytes:
            raise DeviceError(f"opencl slot {slot} ({spec.name!r}): bind_device expected a "
                              f"cl_mem of this device's context with >= {spec.nbytes} bytes, "
                              f"got {size[0]} bytes, same context: {ctx[0] == self.ctx}")
        return mem

    def kick(self, launches: range, deadline: float, value: int) -> None:
        """The launches on the one in-order queue, then a marker whose event is the
        submission's completion; flushed, never waited for here. An injected fault
        (runner/faults.py, by submission: kicks) goes through the driver (_gate)."""
        self.kicks += 1
        fault = self.faults and self.faults.at(self.kicks)
        if fault and fault.kind != "fault":
            check(self.lib.clEnqueueMarkerWithWaitList(self.queue, 1, self._gate(fault),
                                                       ffi.NULL), "clEnqueueMarkerWithWaitList")
        self._enqueue(launches)
        event = ffi.new("cl_event *")
        waits = REFUSED if fault and fault.kind == "fault" else ()
        check(self.lib.clEnqueueMarkerWithWaitList(self.queue, len(waits), waits or ffi.NULL,
                                                   event), "clEnqueueMarkerWithWaitList")
        check(self.lib.clFlush(self.queue), "clFlush")
        self.inflight.append((value, event[0]))

    def _gate(self, fault):
        """hang and slow: a user event the in-order queue holds the submission behind, opened
        by a timer MS from now (slow) or only by reset() (hang: the submission misses its
        deadline). fault: the kick's completion marker lists a null event (REFUSED), which the
        driver refuses (CL_INVALID_EVENT_WAIT_LIST): a DeviceError from submit(), with the
        launches queued and no marker, so recover() must drain the queue."""
        err = ffi.new("cl_int *")
        gate = ffi.new("cl_event *", self.lib.clCreateUserEvent(self.ctx, err))
        check(err[0], "clCreateUserEvent")
        self.gates.append(gate)
        if fault.kind == "slow":
            timer = threading.Timer(fault.ms / 1000, self.lib.clSetUserEventStatus,
                                    (gate[0], CL_COMPLETE))
            timer.start()
            self.timers.append(timer)
        return gate

    def _open_gates(self) -> None:
        """Before draining the queue: every gate still shut opens, so what it holds runs and
        the queue drains (failing it instead makes PoCL 3.1 abort the process)."""
        for timer in self.timers:
            timer.cancel()
        for gate in self.gates:
            self.lib.clSetUserEventStatus(gate[0], CL_COMPLETE)  # refused if already open
        self.lib.clFinish(self.queue)
        for gate in self.gates:
            self.lib.clReleaseEvent(gate[0])
        self.gates, self.timers = [], []

    def completed(self) -> int:
        """Polls each submission's marker event: the timeline never blocks in the driver."""
        status = ffi.new("cl_int *")
        while self.inflight:
            value, event = self.inflight[0]
            check(self.lib.clGetEventInfo(event, CL_EVENT_COMMAND_EXECUTION_STATUS,
                                          ffi.sizeof("cl_int"), status, ffi.NULL),
                  "clGetEventInfo")
            if status[0] < 0:
                raise DeviceError(f"opencl submission {value} failed with execution status "
                                  f"{status[0]}")
            if status[0] != CL_COMPLETE:
                break
            self.done = value
            self.lib.clReleaseEvent(event)
            self.inflight.pop(0)
        return self.done

    def reset(self) -> None:
        """Drain the queue (a lost device returns an error at once), then replace it."""
        self.close()
        self.done = self.value
        self.queue = self._new_queue()

    def _new_queue(self):
        props = 0 if self.events is None else CL_QUEUE_PROFILING_ENABLE
        return ffi.gc(create(self.lib.clCreateCommandQueue, "clCreateCommandQueue", self.ctx,
                             self.dev, props), self.lib.clReleaseCommandQueue)

    def set_profiling(self, on: bool) -> None:
        """Event profiling: a queue created with CL_QUEUE_PROFILING_ENABLE, and an event kept
        per kernel launch, whose START and END the device stamps."""
        self.close()
        self._release_events()
        self.events = ffi.new("cl_event[]", max(len(self.commands), 1)) if on else None
        self.queue = self._new_queue()

    def launch_times(self, launches: range) -> list[Span]:
        stamp = ffi.new("cl_ulong *")
        out = []
        for i in launches:
            times = []
            for param in (CL_PROFILING_COMMAND_START, CL_PROFILING_COMMAND_END):
                check(self.lib.clGetEventProfilingInfo(self.events[i], param, 8, stamp, ffi.NULL),
                      f"clGetEventProfilingInfo (launch {i})")
                times.append(int(stamp[0]))
            out.append(Span(i, 0, *times))
        return out

    def _release_events(self) -> None:
        for i in range(len(self.events) if self.events is not None else 0):
            if self.events[i] != ffi.NULL:
                self.lib.clReleaseEvent(self.events[i])
                self.events[i] = ffi.NULL

    def close(self) -> None:
        """Wait for what is queued (it writes into host arrays and uses the buffers released
        after this); the OpenCL objects are released when the device is collected."""
        if getattr(self, "queue", None) is not None:
            self._open_gates()
        for _, event in getattr(self, "inflight", ()):
            self.lib.clReleaseEvent(event)
        self.inflight = []
        if getattr(self, "events", None) is not None:
            self._release_events()

    def __del__(self):
        self.close()

    def _enqueue(self, launches: range) -> None:
        if self.events is not None:
            self._release_events()
        for i in launches:
            for cmd in self.commands[i]:
                if isinstance(cmd, _Image):
                    self._copy_to_image(cmd)
                    continue
                kernel, dims, gs, ls, name = cmd
                event = ffi.NULL if self.events is None else self.events + i
                check(self.lib.clEnqueueNDRangeKernel(self.queue, kernel, dims, ffi.NULL, gs, ls,
                                                       0, ffi.NULL, event),
                      f"enqueue kernel {name}")

    # ---- memory -------------------------------------------------------------------------------
    def _buffer(self, flags: int, nbytes: int):
        return ffi.gc(create(self.lib.clCreateBuffer, "clCreateBuffer", self.ctx, flags,
                           max(nbytes, 1), ffi.NULL), self.lib.clReleaseMemObject)

    def _tensor(self, b):
        if b.nbytes == 0:
            return self._buffer(CL_MEM_READ_WRITE, b.nbytes)
        parent = self.arena if b.region is Region.ARENA else self.weights
        flags = CL_MEM_READ_WRITE if b.region is Region.ARENA else CL_MEM_READ_ONLY
        return self._sub(parent, b.offset, b.nbytes, flags, f"buffer {b.id}: {b.region}")

    def _sub(self, parent, offset: int, nbytes: int, flags: int, what: str):
        if offset % self.base_align:
            raise BlobError(f"{what} offset {offset} is not a multiple of this device's "
                            f"{self.base_align}-byte base address alignment")
        region = ffi.new("cl_buffer_region *", (offset, nbytes))
        return ffi.gc(create(self.lib.clCreateSubBuffer, f"clCreateSubBuffer({what})", parent,
                             flags, CL_BUFFER_CREATE_TYPE_REGION, region),
                      self.lib.clReleaseMemObject)

    def _image(self, b, alias, parent, offset: int) -> "_Image":
        """b's image: over `alias` (its own buffer) when the device can, else its own memory
        filled by copies from `parent` at `offset`."""
        if b.dtype not in IMAGE_FORMATS:
            raise BlobError(f"buffer {b.id}: images hold float16/float32 or uint8, got {b.dtype}")
        order, channel, n = IMAGE_FORMATS[b.dtype]
        width, height, pitch = b.image.width, b.image.height, b.image.pitch
        texel = n * b.dtype.itemsize
        fmt = ffi.new("cl_image_format *", (order, channel))
        zero_copy = self._aliases(pitch * texel, texel, offset)
        desc = ffi.new("cl_image_desc *")
        desc.image_type, desc.image_height = CL_MEM_OBJECT_IMAGE2D, height
        if zero_copy:
            desc.image_width, desc.image_row_pitch, desc.buffer = width, pitch * texel, alias
        else:
            desc.image_width = pitch  # rows hold the padding too, so one copy moves them all
        limits = [info_uint(self.lib.clGetDeviceInfo, self.dev, p, "size_t")
                  for p in (CL_DEVICE_IMAGE2D_MAX_WIDTH, CL_DEVICE_IMAGE2D_MAX_HEIGHT)]
        if desc.image_width > limits[0] or height > limits[1]:
            raise BlobError(f"buffer {b.id}: image {desc.image_width}x{height} exceeds this "
                            f"device's {limits[0]}x{limits[1]} limit")
        mem = ffi.gc(create(self.lib.clCreateImage, f"clCreateImage(buffer {b.id})", self.ctx,
                          CL_MEM_READ_WRITE if b.region is Region.ARENA else CL_MEM_READ_ONLY,
                          fmt, desc, ffi.NULL), self.lib.clReleaseMemObject)
        # copies read the parent buffer at the tensor's offset: PoCL 3.1 crashes copying from a
        # sub-buffer to an image
        copy = None if zero_copy else (parent, offset, ffi.new("size_t[3]", [0, 0, 0]),
                                       ffi.new("size_t[3]", [pitch, height, 1]))
        return _Image(mem, copy)

    def _aliases(self, row_pitch: int, texel: int, offset: int) -> bool:
        """Can an image alias the buffer (cl_khr_image2d_from_buffer, pitch/base aligned)?"""
        if "cl_khr_image2d_from_buffer" not in self.extensions:
            return False
        get = self.lib.clGetDeviceInfo
        pitch_align = info_uint(get, self.dev, CL_DEVICE_IMAGE_PITCH_ALIGNMENT)
        base_align = info_uint(get, self.dev, CL_DEVICE_IMAGE_BASE_ADDRESS_ALIGNMENT)
        # both limits are in pixels (texels)
        return (pitch_align == 0 or row_pitch % (pitch_align * texel) == 0) and \
            (base_align == 0 or offset % (base_align * texel) == 0)

    def _copy_to_image(self, img: "_Image") -> None:
        src, offset, origin, region = img.copy
        check(self.lib.clEnqueueCopyBufferToImage(self.queue, src, img.mem, offset, origin, region,
                                                   0, ffi.NULL, ffi.NULL),
               "clEnqueueCopyBufferToImage")

    # ---- programs -----------------------------------------------------------------------------
    def _program(self, source: bytes):
        """(program, cache path to save its binary to, or None when it came from the cache)"""
        key = hashlib.sha256(b"\0".join([self.device_name.encode(), self.driver.encode(),
                                         BUILD_OPTIONS, source])).hexdigest()[:32]
        path = Path(self.cache_dir) / f"{key}.bin" if self.cache_dir and self.cache_binaries \
            else None
        if path is not None and path.exists():
            program = self._from_binary(path.read_bytes())
            if program is not None:
                return program, None
        return self._from_source(source), path  # saved after the warm-up run

    def _from_binary(self, binary: bytes):
        lib = self.lib
        devs = ffi.new("cl_device_id[]", [self.dev])
        size = ffi.new("size_t[]", [len(binary)])
        data = ffi.new("char[]", binary)
        ptrs = ffi.new("unsigned char *[]", [ffi.cast("unsigned char *", data)])
        status, err = ffi.new("cl_int *"), ffi.new("cl_int *")
        program = lib.clCreateProgramWithBinary(self.ctx, 1, devs, size, ptrs, status, err)
        if err[0] != CL_SUCCESS or status[0] != CL_SUCCESS:
            return None
        program = ffi.gc(program, lib.clReleaseProgram)
        if lib.clBuildProgram(program, 1, devs, BUILD_OPTIONS, ffi.NULL, ffi.NULL) != CL_SUCCESS:
            return None  # stale cache entry: rebuilt from source
        return program

    def _from_source(self, source: bytes):
        return cl.build(self.ctx, self.dev, source, repr(self.device_name))

    def _save_binary(self, program, path: Path) -> None:
        """Best effort: a read-only or full disk only costs a rebuild next time."""
        data = cl.binary(program)
        if data is None:
            return
        cache.write(path, data)


class _Image:
    """An image param's memory object; `copy` is (buffer, offset, origin, region) when it does
    not alias its buffer and must be refreshed from it after every write."""

    def __init__(self, mem, copy):
        self.mem, self.copy = mem, copy

