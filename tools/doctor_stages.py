"""tools/doctor.py's stages, one list per device, in bring-up order (docs/doctor.md), and what
they share: the vocabulary (Stage, Failure, Probe), the small models they run and the checks of
their answers.

Each stage is a function of a Probe that returns what it measured or raises; it calls one layer
of the driver and names the call it is in (`p.call`), so a failure points at that layer. State a
later stage needs (an open device, a context, a loaded model) is kept in `p.state`, and whatever
must be released is pushed on `p.state["close"]`.
"""
from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("runner", "qcom", "dsp", "am", "usbgpu", "sim", "compiler", "tools")


class Failure(Exception):
    """A stage's own verdict: what it got instead, with its status and the next thing to check."""

    def __init__(self, got: str, status: str = "wrong", next_step: str = ""):
        super().__init__(got)
        self.status, self.next_step = status, next_step


@dataclass(frozen=True)
class Stage:
    name: str  # "<device>.<step>"
    expect: str
    run: Callable  # (Probe) -> what it measured (str)
    next: dict = field(default_factory=dict)  # status or message word -> next step; "" default
    deadline_s: float = 10.0
    needs: tuple = ()  # earlier stages of the device that must have passed (default: all)


class Probe:
    """What a stage sees: the device's shared state, and `call` to name the call it is in."""

    def __init__(self, state: dict):
        self.state, self.current = state, ""

    def call(self, name: str, fn, *args, **kwargs):
        self.current = name
        return fn(*args, **kwargs)


def source_hash() -> str:
    """SHA-256 over keel's sources (path and bytes), so a report names the exact code it ran."""
    h = hashlib.sha256()
    for pkg in SOURCES:
        for p in sorted((ROOT / pkg).rglob("*")):
            if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


# ---- checks the stages share --------------------------------------------------------------

def blob(state: dict, name: str, make, target: str, **options) -> Path:
    """`make()`'s ONNX model compiled for `target`, cached under KEEL_CACHE_DIR/doctor by a hash
    of the model, target and options, and rebuilt when keel's sources changed; its hash is kept
    for the report."""
    from compiler.blob import write_blob
    from compiler.pipeline import compile_model
    model = make()
    key = hashlib.sha256(model.SerializeToString() + repr((target, sorted(options.items())))
                         .encode()).hexdigest()
    folder = Path(os.environ.get("KEEL_CACHE_DIR") or Path.home() / ".cache" / "keel") / "doctor"
    path, sources = folder / f"{name}-{target}-{key[:16]}.blob", source_hash()
    stamp = path.with_suffix(".sources")  # one blob per model and target, rebuilt after edits
    if not path.exists() or not stamp.exists() or stamp.read_text() != sources:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        write_blob(compile_model(model, target=target, **options), tmp)
        os.replace(tmp, path)
        stamp.write_text(sources)
    state["blobs"][path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return path


def compare(got, want, rtol: float, atol: float, what: str) -> str:
    import numpy as np
    err = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))) if got.size \
        else 0.0
    bound = atol + rtol * float(np.max(np.abs(want))) if want.size else atol
    if got.shape != want.shape or not err <= bound:
        raise Failure(f"{what}: max abs error {err:.3g} against the CPU build, bound {bound:.3g} "
                      f"(shape {got.shape}, expected {want.shape})", "wrong answer")
    return f"max abs error {err:.3g} (bound {bound:.3g})"


def against_cpu(p, name: str, make, target: str, device: str, rtol: float, atol: float,
                runs: int = 100, budget_s: float | None = None, **options) -> str:
    """A model on `device` against its CPU build, then its latency over `runs` runs (a fixed
    count: the simulators' faults are counted in submissions), or as many as fit in `budget_s`
    (one at least)."""
    import numpy as np

    from runner import Model
    state = p.state
    model, old = make(), state.pop("model", None)
    if old is not None:  # one model on the device at a time (the amd enclosure has one GPU)
        old.close()
    feeds = _feeds(model)
    want = Model.load(p.call("compile (CPU build)", blob, state, name, make, "cpu"),
                      device="cpu").run(feeds)
    path = p.call(f"compile ({target})", blob, state, name, make, target, **options)
    m = p.call(f"Model.load(device={device!r})", Model.load, path, device=device)
    state["close"].append(m.close)
    got = p.call("Model.run", m.run, feeds, timeout_ms=60_000)
    errs = [compare(got[k], want[k], rtol, atol, k) for k in want]
    times, end = [], time.monotonic() + (budget_s or float("inf"))
    while len(times) < runs and (not times or time.monotonic() < end):
        t = time.perf_counter()
        m.run(feeds, timeout_ms=60_000)
        times.append(time.perf_counter() - t)
    p99 = f", p99 {np.percentile(times, 99) * 1e3:.3f} ms" if len(times) >= 100 else ""
    return (f"{'; '.join(errs)}; latency median {np.median(times) * 1e3:.3f} ms{p99}, "
            f"max {max(times) * 1e3:.3f} ms over {len(times)} run{'s' * (len(times) > 1)}")


def _feeds(model) -> dict:
    import numpy as np
    from onnx import helper
    rng, out = np.random.default_rng(1), {}
    for v in model.graph.input:
        t = v.type.tensor_type
        shape = [d.dim_value for d in t.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        out[v.name] = (rng.integers(-100, 100, shape) if dtype.kind == "i" else
                       rng.standard_normal(shape)).astype(dtype)
    return out


def _model(nodes, inputs, outputs, inits=None, opset: int = 17):
    import numpy as np
    from onnx import helper, numpy_helper
    vi = lambda n, s, d: helper.make_tensor_value_info(  # noqa: E731
        n, helper.np_dtype_to_tensor_dtype(np.dtype(d)), s)
    graph = helper.make_graph(nodes, "doctor", [vi(*i) for i in inputs],
                              [vi(*o) for o in outputs],
                              [numpy_helper.from_array(a, n) for n, a in (inits or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def relu_mul():
    """y = relu(x) * x: one kernel, exact in fp32 and fp16, so its answer is known."""
    from onnx import helper
    return _model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "x"],
                                                                            ["y"])],
                  [("x", (4, 64), "float32")], [("y", (4, 64), "float32")])


def small_net():
    """Conv (stride 2, padded) -> Relu -> Flatten -> Gemm -> Softmax: a float network in small,
    three kernels or more on every GPU target."""
    import numpy as np
    from onnx import helper
    rng = np.random.default_rng(0)
    return _model([helper.make_node("Conv", ["x", "w1", "b1"], ["c"], pads=[1, 1, 1, 1],
                                    strides=[2, 2]),
                   helper.make_node("Relu", ["c"], ["r"]),
                   helper.make_node("Flatten", ["r"], ["f"]),
                   helper.make_node("Gemm", ["f", "w2"], ["g"], transB=1),
                   helper.make_node("Softmax", ["g"], ["y"])],
                  [("x", (1, 3, 16, 16), "float32")], [("y", (1, 10), "float32")],
                  {"w1": rng.standard_normal((16, 3, 3, 3)).astype(np.float32) * 0.3,
                   "b1": rng.standard_normal(16).astype(np.float32) * 0.1,
                   "w2": rng.standard_normal((10, 16 * 8 * 8)).astype(np.float32) * 0.05})


def two_matmuls():
    """MatMul -> Relu -> MatMul: on qcom its weights, and the intermediate one kernel writes and
    the next reads, are images."""
    import numpy as np
    from onnx import helper
    rng = np.random.default_rng(3)
    return _model([helper.make_node("MatMul", ["x", "w1"], ["h"]),
                   helper.make_node("Relu", ["h"], ["r"]),
                   helper.make_node("MatMul", ["r", "w2"], ["y"])],
                  [("x", (1, 64), "float32")], [("y", (1, 16), "float32")],
                  {"w1": rng.standard_normal((64, 256)).astype(np.float32) * 0.1,
                   "w2": rng.standard_normal((256, 16)).astype(np.float32) * 0.1})


def openpilot():
    from models.openpilot import make_openpilot
    return make_openpilot(float16=True)


def int8_fma(n: int = 4096):
    """max(a * b + c, a) on int8: wrapping int8 arithmetic, one HVX vector per 128 lanes."""
    import numpy as np
    from onnx import helper
    c = (np.arange(n) % 7 - 3).astype(np.int8)
    return _model([helper.make_node("Mul", ["a", "b"], ["p"]),
                   helper.make_node("Add", ["p", "c"], ["s"]),
                   helper.make_node("Max", ["s", "a"], ["y"])],
                  [("a", (n,), "int8"), ("b", (n,), "int8")], [("y", (n,), "int8")], {"c": c})


def qdq_conv():
    """DequantizeLinear -> Conv -> Relu -> QuantizeLinear on uint8: a quantizer's QDQ model in
    small, run in integers."""
    import numpy as np
    from onnx import helper
    rng = np.random.default_rng(2)
    f32 = lambda v: np.array(v, np.float32)  # noqa: E731
    nodes = [helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["x"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"]),
             helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("QuantizeLinear", ["r", "ys", "yz"], ["y"])]
    inits = {"xs": f32(0.02), "xz": np.uint8(128), "ws": f32(0.01), "wz": np.int8(0),
             "wq": rng.integers(-60, 60, (8, 4, 3, 3)).astype(np.int8),
             "ys": f32(0.05), "yz": np.uint8(0)}
    return _model(nodes, [("xq", (1, 4, 16, 16), "uint8")], [("y", (1, 8, 16, 16), "uint8")],
                  inits, opset=13)


def known_answer(p, device: str, target: str, make, want_fn) -> str:
    """The one-kernel model through the device's own load, submit and wait, equal to numpy."""
    import numpy as np

    from runner import Model
    path = p.call(f"compile ({target})", blob, p.state, make.__name__, make, target)
    m = p.call(f"Model.load(device={device!r})", Model.load, path, device=device)
    p.state["close"].append(m.close)
    p.state["model"] = m
    feeds = _feeds(make())
    got = p.call("Model.run", m.run, feeds, timeout_ms=10_000)["y"]
    want = want_fn(**feeds)
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    if bad.size:
        i = int(bad[0])
        raise Failure(f"{bad.size} of {want.size} values differ from numpy, first at {i}: got "
                      f"{got.reshape(-1)[i]!r}, expected {want.reshape(-1)[i]!r}", "wrong answer")
    return f"{want.size} values equal to numpy"


def relu_mul_answer(x):
    import numpy as np
    return np.maximum(x, 0) * x


def int8_fma_answer(a, b):
    import numpy as np
    c = (np.arange(a.size) % 7 - 3).astype(np.int8)
    return np.maximum(a * b + c, a)  # numpy's int8 arithmetic wraps, as the kernel's does


ROOT_OR_UDEV = ("run as root, or give your user the device (a udev rule, or chmod 666 on the "
                "node); on Android also check SELinux: `dmesg | grep avc` names the denial")


LATE_S = 0.050  # a bounded wait returning later than this past its deadline overran it


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


# ---- qcom: KGSL on the Adreno 630 ------------------------------------------------------

def _kgsl_open(p):
    from qcom import kgsl
    k = p.call(f"open({kgsl.DEVICE_PATH})", kgsl.Kgsl)
    p.state["kgsl"] = k
    p.state["close"].append(k.close)
    return f"fd {k.fd} on {type(k.driver).__name__}"


def _kgsl_properties(p):
    from qcom import kgsl
    k = p.state["kgsl"]
    info = p.call("IOCTL_KGSL_DEVICE_GETPROPERTY(DEVICE_INFO)", k.devinfo)
    v = p.call("IOCTL_KGSL_DEVICE_GETPROPERTY(VERSION)", k.version)
    p.state["properties"].update(
        chip_id=f"{info.chip_id:#010x}", gpu_id=info.gpu_id, gmem_bytes=info.gmem_sizebytes,
        mmu_enabled=info.mmu_enabled, driver=f"{v.drv_major}.{v.drv_minor}",
        device_version=f"{v.dev_major}.{v.dev_minor}")
    measured = (f"chip {info.chip_id:#010x} (gpu_id {info.gpu_id}), GMEM "
                f"{info.gmem_sizebytes >> 10} KiB, MMU {'on' if info.mmu_enabled else 'off'}, "
                f"driver {v.drv_major}.{v.drv_minor}, device {v.dev_major}.{v.dev_minor}")
    p.current = "the chip id against qcom/kgsl.py VALIDATED_CHIPS"
    if info.chip_id & kgsl.CHIP_MASK not in kgsl.VALIDATED_CHIPS:
        raise Failure(measured, "unvalidated chip",
                      "this GPU is not the comma 3X's Adreno 630: keel's qcom backend refuses "
                      "it (qcom/kgsl.py VALIDATED_CHIPS); use device 'opencl' here")
    if not info.mmu_enabled:
        raise Failure(measured, "no MMU", "KGSL runs without its IOMMU: GPU addresses would be "
                      "physical; check the kernel's kgsl/iommu configuration")
    return measured


def _kgsl_context(p):
    k = p.state["kgsl"]
    flags = k.context_flags()
    ctx = p.call("IOCTL_KGSL_DRAWCTXT_CREATE", k.context_create)
    p.state["ctx"] = ctx
    p.state["close"].append(lambda: k.context_destroy(ctx))
    return f"context {ctx} with flags {flags:#010x} (CL type, no GMEM, no fault tolerance)"


def _kgsl_memory(p):
    k = p.state["kgsl"]
    obj = p.call("IOCTL_KGSL_GPUOBJ_ALLOC", k.alloc, 1 << 16)
    view = p.call("mmap(GPU object)", k.mmap, obj)
    pattern = bytes(range(256)) * 4
    view[:len(pattern)] = pattern
    again = p.call("mmap(GPU object) again", k.mmap, obj)
    if again[:len(pattern)] != pattern:
        raise Failure("a second mapping of the object does not see what the first wrote",
                      "incoherent mapping", "the KGSL mmap offset (object id pages) maps another "
                      "object: check the kernel's kgsl_mmap")
    host = mmap.mmap(-1, 4096)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(host))
    user = p.call("IOCTL_KGSL_GPUOBJ_IMPORT(user memory)", k.import_user, addr, 4096)
    p.call("IOCTL_KGSL_GPUOBJ_FREE", k.free, user.id)
    p.state["objects"] = [obj]
    p.state["close"].append(lambda: k.free(obj.id))
    camera = _kgsl_dmabuf(p, obj)
    return (f"64 KiB object {obj.id} at GPU {obj.gpuaddr:#x} mapped twice, coherent; a page "
            f"of user memory imported at GPU {user.gpuaddr:#x} and freed; {camera}")


def _dmabuf_source(p, nbytes: int):
    """A dma-buf as camerad's are made: ION (the comma 3X's 4.9 kernel has no dma-heaps), or
    under the mock KGSL a memfd standing in for one. (fd, host view, release, what it is)."""
    from qcom import kgsl
    if not isinstance(p.state["kgsl"].driver, kgsl.KernelDriver):
        fd = os.memfd_create("keel-doctor-dmabuf", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        return fd, mmap.mmap(fd, nbytes), lambda: os.close(fd), "a memfd standing in"
    from dsp.fastrpc import Ion
    ion = p.call("ION_IOC_ALLOC + ION_IOC_SHARE (/dev/ion)", Ion, nbytes)
    return ion.fd, ion.map, ion.close, "ION system heap"


def _kgsl_dmabuf(p, target) -> str:
    """A camera-style buffer imported as a GPU object: the host writes a word, then the GPU must
    read it (an IB gated on that word by CP_WAIT_REG_MEM, then a marker write). The word is
    written before the import, as a frame is before modeld binds it; whether a cached ION
    buffer's CPU writes reach the GPU that way is what this shows on a device."""
    from qcom.cmdstream import OPCODES, WAIT_POLL_MEMORY, lohi, pkt7
    k, word, marker = p.state["kgsl"], 0x43414D21, 0x72656164  # "CAM!", "read"
    fd, host, release, kind = _dmabuf_source(p, 4096)
    p.state["close"].append(release)
    host[:4] = word.to_bytes(4, "little")
    buf = p.call("IOCTL_KGSL_GPUOBJ_IMPORT(dma-buf)", k.import_dmabuf, fd)
    p.state["close"].append(lambda: k.free(buf.id))
    p.state["objects"].append(buf)  # lives until the doctor closes: IBs may address it
    view = k.mmap(target)
    view[:4] = bytes(4)
    equal = 3  # cp_cond_function WRITE_EQ, as qcom.deadline's gate
    words = pkt7(OPCODES["CP_WAIT_REG_MEM"], WAIT_POLL_MEMORY | equal, *lohi(buf.gpuaddr), word,
                 0xFFFFFFFF, 16) + _marker_words(target.gpuaddr, marker)
    ts, _ = _submit_words(p, words, "IB gated on the dma-buf's word")
    if not p.call("IOCTL_KGSL_DEVICE_WAITTIMESTAMP_CTXTID", k.wait, p.state["ctx"], ts, 1000):
        raise Failure(f"an IB waiting for the host's word {word:#x} in the imported dma-buf did "
                      f"not retire within 1 s", "GPU does not see the dma-buf",
                      "the GPU reads other pages than the CPU wrote: check the import's "
                      "GPUOBJ_INFO size and gpuaddr, and `dmesg | grep -i kgsl` for a fault")
    if int.from_bytes(view[:4], "little") != marker:
        raise Failure("the gated IB retired without writing its marker", "memory not written",
                      "see qcom.nop: the CP_MEM_WRITE address or the object's mapping is wrong")
    return (f"a {buf.size >> 10} KiB dma-buf ({kind}) imported at GPU {buf.gpuaddr:#x}: the GPU "
            f"read the host's word")


def _submit_words(p, words: list[int], what: str) -> tuple[int, object]:
    """One IB holding `words` on the stage's context: (its timestamp, the IB's GPU object)."""
    from qcom.cmdstream import decode
    k = p.state["kgsl"]
    ib = p.call("IOCTL_KGSL_GPUOBJ_ALLOC(IB)", k.alloc, 4096)
    p.state["close"].append(lambda: k.free(ib.id))
    spans = [(ib.gpuaddr, ib.size)] + [(o.gpuaddr, o.size) for o in p.state["objects"]]
    decode(words, spans)  # a malformed stream is keel's bug, named here before the GPU sees it
    p.call("mmap(IB)", k.mmap, ib)[:4 * len(words)] = b"".join(w.to_bytes(4, "little")
                                                               for w in words)
    ts = p.call(f"IOCTL_KGSL_GPU_COMMAND({what})", k.submit, p.state["ctx"],
                [(ib.gpuaddr, 4 * len(words))])
    return ts, ib


def _marker_words(target: int, marker: int) -> list[int]:
    from qcom.cmdstream import OPCODES, lohi, pkt7
    return (pkt7(OPCODES["CP_NOP"], 0) + pkt7(OPCODES["CP_MEM_WRITE"], *lohi(target), marker)
            + pkt7(OPCODES["CP_WAIT_MEM_WRITES"]) + pkt7(OPCODES["CP_WAIT_FOR_IDLE"]))


def _kgsl_nop(p):
    k, target = p.state["kgsl"], p.state["objects"][0]
    marker = 0x6B65656C  # "keel"
    view = k.mmap(target)
    view[:4] = bytes(4)
    start = time.monotonic()
    ts, _ = _submit_words(p, _marker_words(target.gpuaddr, marker), "NOP + timestamp write")
    retired = p.call("IOCTL_KGSL_DEVICE_WAITTIMESTAMP_CTXTID", k.wait, p.state["ctx"], ts, 2000)
    took = time.monotonic() - start
    if not retired:
        raise Failure(f"timestamp {ts} not retired within 2 s", "not retired",
                      "the CP did not run the IB: check `dmesg | grep -i kgsl` for a GPU fault "
                      "or hang, and that the ringbuffer is not stalled by another context")
    got = int.from_bytes(view[:4], "little")
    if got != marker:
        raise Failure(f"timestamp {ts} retired but the marker word holds {got:#x}, expected "
                      f"{marker:#x}", "memory not written", "the CP_MEM_WRITE address or the "
                      "object's GPU mapping is wrong: compare GPUOBJ_INFO's gpuaddr with the IB")
    return f"timestamp {ts} retired in {_ms(took)}, marker written"


def _kgsl_deadline(p):
    """An IB that waits (CP_WAIT_REG_MEM) for a word the host has not written yet: a 10 ms wait
    must give up on time, as the device's DeviceTimeout does; once the host writes the word, the
    IB must run on and retire within 1 s."""
    from qcom.cmdstream import OPCODES, WAIT_POLL_MEMORY, lohi, pkt7
    k, target = p.state["kgsl"], p.state["objects"][0]
    view, gate, marker = k.mmap(target), target.gpuaddr + 64, 0x676F  # "go"
    view[64:68], view[:4] = bytes(4), bytes(4)
    equal = 3  # cp_cond_function WRITE_EQ: (word & mask) == reference
    words = pkt7(OPCODES["CP_WAIT_REG_MEM"], WAIT_POLL_MEMORY | equal, *lohi(gate), 1,
                 0xFFFFFFFF, 16) + _marker_words(target.gpuaddr, marker)
    ts, _ = _submit_words(p, words, "IB gated on a memory word")
    start = time.monotonic()
    done = p.call("Kgsl.wait(10 ms)", k.wait, p.state["ctx"], ts, 10)
    tiny = time.monotonic() - start
    if done:
        raise Failure(f"the gated IB retired before its gate was opened (marker "
                      f"{int.from_bytes(view[:4], 'little'):#x})", "did not wait",
                      "CP_WAIT_REG_MEM did not block: its payload layout (qcom/cmdstream.py) "
                      "is wrong for this CP")
    if tiny > 0.010 + LATE_S:
        raise Failure(f"a 10 ms wait returned after {_ms(tiny)}", "overran",
                      "KGSL's WAITTIMESTAMP overruns its timeout: every run's deadline is at "
                      "risk; report the kernel version")
    view[64:68] = (1).to_bytes(4, "little")
    start = time.monotonic()
    done = p.call("Kgsl.wait(1 s)", k.wait, p.state["ctx"], ts, 1000)
    took = time.monotonic() - start
    if took > 1.0 + LATE_S:
        raise Failure(f"a wait with a 1 s deadline returned after {_ms(took)}", "overran",
                      "KGSL's WAITTIMESTAMP overruns its timeout: report the kernel version")
    if not done:
        raise Failure(f"timestamp {ts} not retired within 1 s of opening its gate (the wait "
                      f"returned on time, after {_ms(took)})", "DeviceTimeout",
                      "the CP does not see the host's write (a cached mapping?) or the GPU is "
                      "busy; check `dmesg | grep -i kgsl`")
    return (f"closed gate: the 10 ms wait gave up on time ({_ms(tiny)}), as DeviceTimeout; "
            f"gate opened: retired in {_ms(took)}")


def _kgsl_dispatch(p):
    """relu(x) * x, one kernel, through the vendor compiler (the mock's own binaries under
    KEEL_KGSL=mock), the binary parser, the recorder and one submission."""
    return known_answer(p, "qcom", "qcom", relu_mul, relu_mul_answer)


def _kgsl_image(p):
    """Two kernels through an image: the first writes it, the second reads it (and the weights
    are images too), against the CPU build."""
    from runner.blob import read_blob
    path = p.call("compile (qcom)", blob, p.state, "two_matmuls", two_matmuls, "qcom")
    images = [b for b in read_blob(path).buffers.values() if b.image is not None]
    if not any(b.region == "arena" for b in images):
        raise Failure(f"the qcom blob holds {len(images)} images, none written by a kernel",
                      "no image", "keel's compiler stopped choosing images for this model "
                      "(compiler/schedule/storage.py): a keel bug, not the device's")
    # fp16 storage and arithmetic on qcom against fp32 on the CPU: 64 and 256 terms summed
    return f"{len(images)} images; " + against_cpu(p, "two_matmuls", two_matmuls, "qcom", "qcom",
                                                   1e-2, 1e-2)


def _qcom_openpilot(p):
    # fp16 on qcom against the CPU build's fp32 compute: tests/test_qcom_device.py's bound
    return against_cpu(p, "openpilot", openpilot, "qcom", "qcom", 5e-2, 5e-2, budget_s=5.0,
                       float16=True)


def _qcom_model(p):
    # qcom blobs compute in half: the fp16 bound of tests/test_qcom_device.py's conv_net
    return against_cpu(p, "small_net", small_net, "qcom", "qcom", 1e-2, 1e-2)


KGSL_ERRNO = {"ENOENT": "no /dev/kgsl-3d0: not a Qualcomm device, or the kgsl driver is not "
                        "loaded (`ls -l /dev/kgsl*`, `dmesg | grep -i kgsl`)",
              "EACCES": ROOT_OR_UDEV, "EPERM": ROOT_OR_UDEV}


def qcom() -> list[Stage]:
    return [
        Stage("qcom.open", "/dev/kgsl-3d0 opens read-write", _kgsl_open, KGSL_ERRNO),
        Stage("qcom.properties", "a validated chip (Adreno 630, 0x0603000x) with its MMU on",
              _kgsl_properties, {"": "the GETPROPERTY ioctl failed: compare the kernel's "
                                     "msm_kgsl.h with qcom/kgsl.py (tests/test_qcom_uapi.py)"},
              needs=("qcom.open",)),
        Stage("qcom.context", "a CL context with keel's flags", _kgsl_context,
              {"EINVAL": "the kernel refuses keel's context flags: check its msm_kgsl.h "
                         "CONTEXT_* bits against qcom/kgsl.py", "": "see dmesg for kgsl"},
              needs=("qcom.open",)),
        Stage("qcom.memory", "alloc, mmap (twice, coherent), user-memory import, free; a "
              "dma-buf (ION; a memfd on the mock) imported, the GPU reads the host's word",
              _kgsl_memory, {"ENOMEM": "the GPU's memory is exhausted: close other GPU users "
                             "(the UI, camerad) and retry",
                             "EBADF": "the dma-buf fd was closed before its import",
                             "EINVAL": "KGSL refused the object or the dma-buf: a dma-buf "
                             "import needs the kernel's CONFIG_DMA_SHARED_BUFFER and an fd that "
                             "is one", "": "check `dmesg | grep -i kgsl`"},
              needs=("qcom.open", "qcom.context")),
        Stage("qcom.nop", "an IB of CP_NOP + CP_MEM_WRITE retires within 2 s and writes its "
              "marker", _kgsl_nop, {"EDEADLK": "the context faulted: `dmesg | grep -i kgsl` "
                                    "shows the fault address"},
              needs=("qcom.context", "qcom.memory")),
        Stage("qcom.deadline", "a 10 ms wait on an IB gated on memory gives up on time; "
              "opened, it retires within 1 s", _kgsl_deadline,
              needs=("qcom.context", "qcom.memory")),
        Stage("qcom.dispatch", "relu(x)*x, one kernel: vendor compiler, parser, recorder, "
              "submit; equal to numpy", _kgsl_dispatch, {
                  "wrong answer": "the kernel ran but computed something else: the parsed "
                  "registers or instruction length (qcom/vendor.py) disagree with the binary; "
                  "send the bundle", "EDEADLK": "the dispatch faulted the GPU: see dmesg for "
                  "the fault address (a wrong SP_CS_* register or constant layout)"},
              deadline_s=120.0,
              needs=("qcom.properties",)),
        Stage("qcom.image", "an image written by one kernel and read by the next, within fp16 "
              "tolerance (1e-2) of the CPU build", _kgsl_image, {
                  "EDEADLK": "an image access faulted the GPU: the texture descriptor or sampler "
                  "(qcom/texture.py) is wrong for this chip; see dmesg for the fault address",
                  "wrong answer": "images read back wrong: the descriptor's pitch, format or "
                  "tiling (qcom/texture.py); send the bundle"}, deadline_s=300.0,
              needs=("qcom.properties",)),
        Stage("qcom.model", "a conv net within fp16 tolerance (1e-2) of its CPU build, with "
              "latency", _qcom_model, {"wrong answer": "single kernels pass but a graph does "
                                       "not: barriers (CP_WAIT_FOR_IDLE); run tools/bisect.py "
                                       "on the model"}, deadline_s=300.0,
              needs=("qcom.properties",)),
        Stage("qcom.openpilot", "the openpilot-shaped model (fp16 weights) within 5e-2 of its "
              "CPU build, with latency", _qcom_openpilot,
              {"wrong answer": "run tools/bisect.py on the model to find the first node that "
               "diverges", "DeviceTimeout": "the model did not finish in 60 s: the GPU is "
               "throttled or hung; check `dmesg | grep -i kgsl`"}, deadline_s=600.0,
              needs=("qcom.properties",)),
    ]


# ---- dsp: FastRPC to the cDSP, or qemu-hexagon --------------------------------------------

def _dsp_node(p):
    import ctypes as c

    from dsp import build, fastrpc
    from runner.simulators import simulator
    if simulator("KEEL_FASTRPC") is not None:  # the emulated DSP: its tools stand for the node
        why = p.call("dsp.build.missing", build.missing)
        if why:
            raise Failure(why, "ENOENT", "install the Hexagon toolchain and qemu-user "
                          "(scripts/setup.sh), or unset KEEL_FASTRPC to use the device's DSP")
        return ", ".join(shutil.which(tool) for tool in build.PACKAGES)
    fd = p.call(f"open({fastrpc.RPC_NODE})", os.open, fastrpc.RPC_NODE, os.O_RDONLY | os.O_CLOEXEC)
    try:
        p.call("FASTRPC_IOCTL_GETINFO(cDSP)", fastrpc._ioctl, fd, fastrpc.GETINFO,
               c.c_uint32(fastrpc.CDSP), "selecting the cDSP")
    finally:
        os.close(fd)
    return f"{fastrpc.RPC_NODE} open, GETINFO selected domain {fastrpc.CDSP} (cDSP)"


def _dsp_memory(p):
    from dsp.device import transport
    link = p.call("transport()", transport)
    p.state["close"].append(link.close)
    shm = p.call("alloc(1 MiB) (ION + dma-buf, or a memfd)", link.alloc, 1 << 20)
    pattern = bytes(range(256)) * 16
    shm[:len(pattern)] = pattern
    if shm[:len(pattern)] != pattern:
        raise Failure("the shared buffer does not hold what was written", "incoherent")
    return f"1 MiB shared buffer on {type(link).__name__}, written and read back"


def _dsp_session(p):
    """The PD, the skel through remotectl and the programs loaded: Model.load on device dsp."""
    from runner import Model
    path = blob(p.state, "int8_fma", int8_fma, "dsp")
    start = time.monotonic()
    m = p.call("Model.load(device='dsp')", Model.load, path, device="dsp")
    p.state["close"].append(m.close)
    p.state["model"] = m
    return f"session open and programs loaded in {_ms(time.monotonic() - start)}"


def _dsp_invoke(p):
    import numpy as np
    m = p.state["model"]
    feeds = {k: np.zeros(s, d) for k, (s, d) in m.inputs.items()}
    times = []
    for _ in range(20):
        t = time.perf_counter()
        p.call("FASTRPC_IOCTL_INVOKE (Model.run)", m.run, feeds, timeout_ms=2000)
        times.append(time.perf_counter() - t)
    return (f"20 invokes of a one-kernel graph: round trip median {_ms(statistics.median(times))}"
            f", max {_ms(max(times))}")


def _dsp_known_answer(p):
    return known_answer(p, "dsp", "dsp", int8_fma, int8_fma_answer)


def _dsp_model(p):
    # integer arithmetic with one requantization each: the same code on both, so exact
    return against_cpu(p, "qdq_conv", qdq_conv, "dsp", "dsp", 0.0, 0.0)


def dsp() -> list[Stage]:
    return [
        Stage("dsp.node", "/dev/adsprpc-smd opens and GETINFO selects the cDSP (mock: "
              "qemu-hexagon, clang-19 and lld-19 found)", _dsp_node,
              {"ENOENT": "no FastRPC node: not a Qualcomm device, or adsprpc is not loaded "
                         "(`ls -l /dev/adsprpc*`, `dmesg | grep -i adsprpc`)",
               "EACCES": ROOT_OR_UDEV, "EPERM": ROOT_OR_UDEV}, deadline_s=120.0),
        Stage("dsp.memory", "1 MiB of shared memory (ION, shared as a dma-buf)", _dsp_memory,
              {"absent": "no /dev/ion: this kernel uses dma-buf heaps, which keel's FastRPC "
                         "layer does not speak yet (docs/dsp.md)",
               "ENOMEM": "the ION system heap is exhausted: stop other DSP and camera users "
                         "(or reboot) and retry", "EACCES": ROOT_OR_UDEV, "EPERM": ROOT_OR_UDEV,
               "": "see `dmesg | grep -i ion`"},
              needs=("dsp.node",)),
        Stage("dsp.session", "an unsigned PD created, the skel opened through remotectl, the "
              "programs loaded", _dsp_session,
              {"unsigned": "signed PD required: build a testsig for this device's serial "
                           "(testsig-<serial>.so in /dsp), or firmware that allows unsigned PDs",
               "skel": "the DSP's loader could not open the skel: check KEEL_DSP_SKEL and "
                       "`python -m dsp.build`", "": "see `dmesg | grep -i adsprpc`"},
              deadline_s=180.0,
              needs=("dsp.node",)),
        Stage("dsp.invoke", "20 invokes of a one-kernel graph answer, with their round trip",
              _dsp_invoke, {"DeviceTimeout": "the DSP took the invoke and never answered: "
                            "the PD is stuck; `dmesg | grep -i adsprpc`, then reboot the DSP "
                            "(reboot the device)"}, deadline_s=150.0,
              needs=("dsp.session",)),
        Stage("dsp.known_answer", "max(a*b+c, a) on int8 (HVX), equal to numpy",
              _dsp_known_answer, {"wrong answer": "the HVX kernel ran but computed something "
                                  "else: send the bundle (the blob's hash names the program)"},
              deadline_s=60.0,
              needs=("dsp.node",)),
        Stage("dsp.model", "a QDQ conv equal to its CPU build, with latency", _dsp_model,
              {"wrong answer": "single kernels pass but a graph does not: run tools/bisect.py "
               "on the model"}, deadline_s=300.0,
              needs=("dsp.node",)),
    ]


# ---- amd: an RX 7900 behind an ASM2464 ---------------------------------------------------

def _usb(p):
    from usbgpu import asm24, pci
    lib = p.call("libusb_init (usbgpu.pci.open_lib)", pci.open_lib)
    usb = p.call("libusb_open_device_with_vid_pid (ASM24xx ids)", pci._open, lib)
    ids = "{:04x}:{:04x}".format(*usb.ids)
    p.state["properties"]["usb_id"] = ids
    version = p.call(f"E4 XDATA read {asm24.FW_VERSION:#06x} (firmware version)",
                     asm24.Bridge(usb).firmware_version)
    p.state["properties"]["bridge_firmware"] = version
    p.call("libusb_close", usb.close)
    return (f"bridge {ids} opened, interface claimed (UAS alt setting, streams), firmware "
            f"{version} (a vendor XDATA read), released")


def _pcie(p):
    from usbgpu import pci
    dev = p.call("UsbPci (enumerate the PCIe tree, size BARs)", pci.UsbPci)
    p.state["pci"] = dev
    p.state["close"].append(dev.close)
    vid, did = dev.cfg_read(pci.VENDOR, 2), dev.cfg_read(pci.VENDOR + 2, 2)
    bars = ", ".join(f"BAR{i} {size >> 20} MiB" for i, (_, size) in sorted(dev.bars.items()))
    p.state["properties"].update(pci_id=f"{vid:04x}:{did:04x}", bus=dev.bus,
                                 bars={i: s for i, (_, s) in dev.bars.items()})
    if vid != 0x1002:
        raise Failure(f"function {vid:04x}:{did:04x} on bus {dev.bus}", "not AMD",
                      "the display function behind the bridge is not an AMD GPU")
    return f"GPU {vid:04x}:{did:04x} on bus {dev.bus} behind bridges {dev.path}; {bars}"


def _gpu(p):
    from am.driver import Gpu
    gpu = p.call("am.driver.Gpu (VRAM location registers)", Gpu, p.state["pci"], steps=())
    p.state["gpu"] = gpu
    return gpu


def _discovery(p):
    gpu = _gpu(p)
    p.call("am.driver.discover (BAR0, below the top of VRAM)", gpu.step, "discovery")
    ips = ", ".join(f"{ip.name if hasattr(ip, 'name') else ip.hw_id} "
                    f"{'.'.join(map(str, ip.version))}" for ip in gpu.ips.values())
    p.state["properties"]["ip_versions"] = {f"{k[0]}.{k[1]}": ".".join(map(str, ip.version))
                                            for k, ip in gpu.ips.items()}
    return f"{len(gpu.ips)} IP blocks: {ips}"


def _firmware(p):
    from am import firmware
    gpu = p.state["gpu"]
    p.call(f"am.firmware.load_all ({firmware.folder()})", gpu.step, "firmware")
    files = ", ".join(f"{f.name} ({len(f.parts)} parts)" for f in gpu.fws)
    return f"{len(gpu.fws)} files parsed: {files}"


def _step(name: str, what: str, done: str):
    def run(p):
        p.call(what, p.state["gpu"].step, name)
        return done
    return run


def _nop(p):
    """An indirect buffer holding one NOP, submitted as a graph is (INDIRECT_BUFFER, then the
    RELEASE_MEM the host polls for)."""
    from am import pm4
    from am.driver import BOOT_TIMEOUT_S
    gpu, deadline = p.state["gpu"], time.monotonic() + BOOT_TIMEOUT_S
    words = pm4.nop(4)
    ib = p.call("Gpu.alloc (the IB's page)", gpu.alloc, 4096, deadline)
    p.call("Gpu.upload (the IB)", gpu.upload, ib, b"".join(w.to_bytes(4, "little")
                                                           for w in words), deadline)
    start = time.monotonic()
    p.call("INDIRECT_BUFFER + RELEASE_MEM (Gpu.post)", gpu.post,
           pm4.indirect_buffer(ib, len(words)), b"", start + BOOT_TIMEOUT_S)
    return f"an IB of one NOP ran and its RELEASE_MEM signalled in {_ms(time.monotonic() - start)}"


def _vram(p):
    gpu, n = p.state["gpu"], 3 << 20
    deadline = time.monotonic() + 30.0
    va = p.call("Gpu.alloc (page table update + TLB flush)", gpu.alloc, n, deadline)
    data = bytes(os.urandom(n))
    p.call("Gpu.upload (DMA_DATA from the staging memory)", gpu.upload, va, data, deadline)
    piece = 64 << 10
    for at, pages in ((0, "2 MiB"), (n - piece, "4 KiB")):  # one piece on each kind of leaf
        back = bytearray(piece)
        p.call("Gpu.download", gpu.download, va + at, memoryview(back), deadline)
        if bytes(back) != data[at:at + piece]:
            raise Failure(f"64 KiB at offset {at:#x} of a 3 MiB buffer (its {pages} pages) read "
                          f"back differ from what was written", "wrong memory",
                          f"the page table maps {pages} pages to the wrong VRAM (am/vm.py): "
                          f"send the bundle")
    return f"3 MiB at GPU {va:#x} written; 64 KiB on its 2 MiB and on its 4 KiB pages read back"


def _amd_known_answer(p):
    for fn in p.state["close"]:  # the model brings the GPU up itself: release this one first
        fn()
    p.state["close"].clear()
    return known_answer(p, "amd", "amd", relu_mul, relu_mul_answer)


def _amd_model(p):
    # the same OpenCL C semantics in fp32 on both: summation order alone differs
    return against_cpu(p, "small_net", small_net, "amd", "amd", 1e-4, 1e-5)


LINK_DOWN = ("the PCIe link behind the bridge is down (nothing answers past the bridge's own "
             "port): the GPU has no power (its 8-pin cables), is not seated, or the bridge runs "
             "stock firmware")
AMD_USB = {"no ASM24xx": "no bridge on USB: check the cable, power, and `lsusb` for 174c:2464; "
                         "on Linux the uas driver must let go (run as root)",
           "LIBUSB_ERROR_ACCESS": ROOT_OR_UDEV, "LIBUSB_ERROR_BUSY": "another process or the "
           "kernel's uas driver holds the enclosure: run as root so keel can detach it"}


def _hub(name: str) -> dict:
    return {"TLB invalidation": f"the {name} hub never acknowledged a TLB invalidation: its VM "
            f"context 0 or L2/TLB setup (am/driver.py, am/gc.py) is not what this GPU expects; "
            f"send the bundle", "": "the bring-up step named in the call did not complete: "
            "send the bundle"}


def amd() -> list[Stage]:
    psp_next = {"refused": "the PSP refused a firmware image: its version does not match this "
                "GPU, or the bridge runs stock firmware; the message names the file",
                "": "the bring-up step named in the call did not complete: send the bundle"}
    queue_next = {"GPU queue": "the compute queue never ran its packets: MEC is not running, or "
                  "the MQD or doorbell routing is wrong (am/mqd.py, am/gc.py); send the bundle"}
    return [
        Stage("amd.usb", "an ASM24xx bridge (174c:2464 or 2d01:3666) opens, its interface "
              "claimed; its firmware version read (vendor CDB E4)", _usb, AMD_USB),
        Stage("amd.pcie", "the link up: an AMD display function behind the bridge, BARs sized",
              _pcie, {"no display-class": LINK_DOWN, "unsupported request": LINK_DOWN,
                      "": "send the bundle"}, deadline_s=30.0),
        Stage("amd.discovery", "the IP discovery table read and checked", _discovery,
              {"": "the table near the top of VRAM is unreadable: BAR0 does not reach the top of "
               "VRAM (enable resizable BAR) or VRAM is not initialised"}, deadline_s=30.0),
        Stage("amd.firmware", "every firmware file the IP versions need, found and parsed",
              _firmware, {"": "install linux-firmware's amdgpu/ files (README \"AMD GPU over "
                          "USB\") or point KEEL_AMD_FIRMWARE at them"}),
        Stage("amd.mm_hub", "doorbell aperture, MM hub VM context 0 on keel's page table, TLB "
              "flushed", _step("mm_hub", "Gpu._start_mm",
              "doorbell aperture open; MM hub context 0 maps the staging memory; TLB flushed"),
              _hub("MM"), deadline_s=30.0),
        Stage("amd.psp", "the PSP boots sOS and loads SMU, PFP/ME/MEC/IMU/RLC; MEC started",
              _step("psp", "am.boot.Psp.bring_up", "sOS booted "
              "(bootloader components), its ring up, TOC, SMU, TMR, PFP/ME/MEC/IMU/RLC loaded, "
              "RLC autoload complete, MEC pipe 0 started"), psp_next, deadline_s=120.0),
        Stage("amd.gc_hub", "GC hub context 0, L2/TLB, SH_MEM, doorbell routing",
              _step("gc_hub", "Gpu._gc_hub", "GC hub "
              "context 0 on the table, L2 and TLB set up and flushed, SH_MEM, doorbells routed"),
              _hub("GC"), deadline_s=30.0),
        Stage("amd.queue", "the compute queue mapped from its MQD, the page tables written "
              "through it", _step("queue", "Gpu._queue", "queue mapped "
              "(ME 1 pipe 0 queue 0), tables written through it, GC range opened"),
              queue_next, deadline_s=30.0),
        Stage("amd.nop", "an IB holding a NOP runs on the compute queue and signals", _nop,
              {"DeviceTimeout": "the queue does not run: MEC not started or the doorbell not "
               "routed; send the bundle"}, deadline_s=15.0,
              needs=("amd.queue",)),
        Stage("amd.vram", "3 MiB through the VM (2 MiB and 4 KiB pages) written and read back",
              _vram, deadline_s=60.0,
              needs=("amd.queue",)),
        Stage("amd.known_answer", "relu(x)*x, one kernel, equal to numpy", _amd_known_answer,
              {"wrong answer": "the kernel ran but computed something else: the code object "
               "or its kernargs (am/graph.py); send the bundle"}, deadline_s=180.0,
              needs=("amd.queue",)),
        Stage("amd.model", "a conv net within 1e-4 of its CPU build, with latency", _amd_model,
              {"wrong answer": "single kernels pass but a graph does not: run tools/bisect.py "
               "on the model"}, deadline_s=300.0,
              needs=("amd.queue",)),
    ]



def stages(device: str) -> list[Stage]:
    return {"qcom": qcom, "dsp": dsp, "amd": amd}[device]()
