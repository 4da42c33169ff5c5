"""Hostile-input fuzzing (issue 18): mutated blobs, mutated ONNX models, extreme feeds.

    python -m tests.fuzz_inputs --blobs 100000 --onnx 10000 --feeds 2000   # the long mode

Every outcome must be a success with correct results or a typed keel error. A crash (the worker
process dies), a hang (no answer within the deadline), any other exception type, or a wrong
answer (output differs from the unmutated blob's, or from onnxruntime's) is a failure. Mutation i
of a kind is a pure function of (seed, kind, i): `--kind K --start i --count 1` replays it.

Mutators:
  blob raw      bytes flipped, set, inserted, deleted, or the file truncated/extended, anywhere;
                nothing resealed, so every change must be caught (then the run must match)
  blob header   one header field set to an interesting value (0, -1, huge, off by one)
  blob manifest one manifest leaf (sections' offsets/sizes/hashes, buffers, launches, io, arena)
                replaced, a key dropped or a list entry duplicated, then every hash resealed, so
                the reader's meaning checks are what must catch it; accepted blobs are loaded
  onnx bytes    the serialized model's bytes flipped, inserted, deleted or truncated
  onnx graph    wrong ranks, huge/negative/zero dims, dangling names, cycles, wrong dtypes,
                attributes set to odd values, nodes dropped or given another op; a model that
                compiles is run on random feeds and compared with onnxruntime when it accepts it
  feeds         NaN, +-Inf, +-0, denormals and huge values fed to a graph of NaN-sensitive ops
                (tests/test_hostile.py), compared with onnxruntime (with onnx's reference
                implementation for max/min reductions, whose NaN onnxruntime may drop)
  run-alias     out= arrays that are feeds, views of feeds, input slots, bound inputs, or each
                other (issue 33); feeds contiguous or not, as a dict or through the slots: the
                outputs equal a run on copies, or two outputs in one array are an InputError
                that leaves every array as it was
  run-events    what happens around a run: SIGINT at a random moment (2 threads), close() from
                another thread, fork() then a run in the child, the blob file truncated,
                overwritten in place, replaced or deleted after load, two threads running one
                Model: a typed error or the right outputs, never a crash or a hang
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

KINDS = ("blob-raw", "blob-header", "blob-manifest", "onnx-bytes", "onnx-graph", "feeds",
         "run-alias", "run-events")
# per mutation, in CPU seconds of the worker (a loaded machine slows it, a hang spins); at most
# WALL_FACTOR times that in wall time (a hang that sleeps, or a compiler child that spins)
DEADLINE_S = {"blob": 10.0, "onnx": 60.0, "feeds": 30.0, "run": 30.0}
WALL_FACTOR = 20
INTERESTING = [0, 1, -1, 2, 7, 255, 4096, 2**31 - 1, 2**31, 2**32, 2**63 - 1, -2**63, 10**30]


# ---- blobs ---------------------------------------------------------------------------------

def base_blob(tmp: Path) -> Path:
    """A small real blob: conv + relu + residual add + global pool, weights and arena buffers."""
    from compiler.blob import write_blob
    from compiler.pipeline import compile_model
    path = tmp / "base.blob"
    write_blob(compile_model(_conv_model()), path)
    return path


def _conv_model():
    from onnx import helper
    from tests.graphs import make_model
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("ReduceMean", ["r"], ["m"], axes=[1], keepdims=1),
             helper.make_node("Add", ["x", "m"], ["y"]),
             helper.make_node("GlobalAveragePool", ["r"], ["z"])]
    return make_model(nodes, [("x", (1, 3, 6, 6), "float32")],
                      [("y", (1, 3, 6, 6), "float32"), ("z", (1, 4, 1, 1), "float32")],
                      {"w": w}, opset=13)


def mutate_blob(kind: str, data: bytes, rng: random.Random) -> bytes:
    if kind == "blob-raw":
        return _raw(data, rng)
    from runner.format import HEADER
    if kind == "blob-header":
        fields = list(HEADER.unpack_from(data))
        k = rng.randrange(len(fields))
        if isinstance(fields[k], bytes):
            fields[k] = bytes(rng.choice([0, 0x41, 0xFF]) for _ in range(len(fields[k])))
        else:
            fields[k] = rng.choice([v for v in INTERESTING + [fields[k] + 1, fields[k] - 1]
                                    if 0 <= v < 2**32])
        return HEADER.pack(*fields) + data[HEADER.size:]
    manifest = json.loads(_manifest_bytes(data))
    _mutate_json(manifest, rng)
    return reseal(data, manifest)


def _raw(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.choice([1, 1, 1, 2, 8])):
        op, at = rng.randrange(6), rng.randrange(len(out) + 1)
        if op == 0 and at < len(out):
            out[at] ^= 1 << rng.randrange(8)
        elif op == 1 and at < len(out):
            out[at] = rng.randrange(256)
        elif op == 2:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.choice([1, 4, 4096])))
        elif op == 3:
            del out[at:at + rng.choice([1, 4, 4096])]
        elif op == 4:
            del out[at:]
        else:
            out += bytes(rng.choice([1, 8, 4096]))
    return bytes(out)


def _manifest_bytes(data: bytes) -> bytes:
    from runner.format import HEADER
    fields = HEADER.unpack_from(data)
    m_offset, m_size = fields[5], fields[6]  # HEADER: magic, version, size, flags, file size, ...
    return data[m_offset:m_offset + m_size]


def reseal(data: bytes, manifest: dict) -> bytes:
    """`data` with `manifest` in place of its manifest, and the header's sizes and both SHA-256s
    recomputed, so only the manifest's meaning can be wrong."""
    from runner.format import FILE_SHA256_AT, HEADER, canonical_json, file_sha256
    fields = list(HEADER.unpack_from(data))
    text = canonical_json(manifest)
    out = bytearray(data[:fields[5]] + text)
    fields[4], fields[6], fields[7] = len(out), len(text), hashlib.sha256(text).digest()
    HEADER.pack_into(out, 0, *fields)
    try:
        sections = [(int(s["offset"]), int(s["size"])) for s in manifest["sections"]]
        digest = file_sha256(out, sections)
    except Exception:  # a mangled table: hash as if it were right; the reader must say why not
        digest = hashlib.sha256(bytes(out)).digest()
    out[FILE_SHA256_AT:FILE_SHA256_AT + 32] = digest
    return bytes(out)


def _leaves(node, path=()):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, path + (i,))


def _mutate_json(doc, rng: random.Random) -> None:
    paths = [p for p, _ in _leaves(doc) if p]
    path = rng.choice(paths)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key, old = path[-1], parent[path[-1]]
    op = rng.randrange(10)
    if op == 0 and isinstance(parent, dict):
        del parent[key]
    elif op == 1 and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(old))
    elif op == 2:
        parent[key] = rng.choice([None, "", "x" * 100, [], {}, True, 0.5, [0, 1], {"a": 1}])
    elif isinstance(old, bool) or not isinstance(old, int):
        parent[key] = rng.choice(INTERESTING) if op < 6 else _nudge_text(old, rng)
    else:
        parent[key] = rng.choice(INTERESTING + [old + 1, old - 1, old * 2, -old, old + 4096])


def _nudge_text(old, rng: random.Random):
    if isinstance(old, str) and old:
        i = rng.randrange(len(old))
        return old[:i] + rng.choice("0fz/.\0é") + old[i + 1:]
    return old


# ---- ONNX models ---------------------------------------------------------------------------

def base_models() -> list:
    from onnx import helper
    from tests.graphs import make_model
    rng = np.random.default_rng(1)
    mm = make_model([helper.make_node("MatMul", ["x", "w"], ["h"]),
                     helper.make_node("Softmax", ["h"], ["y"], axis=-1)],
                    [("x", (2, 8), "float32")], [("y", (2, 4), "float32")],
                    {"w": rng.standard_normal((8, 4)).astype(np.float32)})
    shp = make_model([helper.make_node("Reshape", ["x", "s"], ["r"]),
                      helper.make_node("Transpose", ["r"], ["t"], perm=[1, 0]),
                      helper.make_node("Concat", ["t", "t"], ["c"], axis=0),
                      helper.make_node("Gather", ["c", "i"], ["y"], axis=1)],
                     [("x", (2, 3, 4), "float32"), ("i", (3,), "int64")],
                     [("y", (24, 3), "float32")], {"s": np.array([6, 4])})
    return [_conv_model(), mm, shp]


def mutate_onnx(kind: str, model, rng: random.Random) -> bytes:
    data = model.SerializeToString()
    if kind == "onnx-bytes":
        return _raw(data, rng)
    m = copy.deepcopy(model)
    for _ in range(rng.choice([1, 1, 2])):
        rng.choice(GRAPH_MUTATIONS)(m.graph, rng)
    return m.SerializeToString()


def _some_value_info(g, rng):
    return rng.choice(list(g.input) + list(g.output))


def _rank(g, rng):
    dims = _some_value_info(g, rng).type.tensor_type.shape.dim
    if dims and rng.random() < 0.5:
        del dims[rng.randrange(len(dims))]
    else:
        dims.add().dim_value = rng.choice([1, 2, 3])


def _dim(g, rng):
    dims = _some_value_info(g, rng).type.tensor_type.shape.dim
    if dims:
        d = dims[rng.randrange(len(dims))]
        if rng.random() < 0.2:
            d.dim_param = "n"
        else:
            d.dim_value = rng.choice([0, 1, 5, 2**31, 2**40, 99999999999, -1, -7])


def _dangling(g, rng):
    node = rng.choice(g.node)
    if node.input:
        node.input[rng.randrange(len(node.input))] = rng.choice(["nowhere", "", "y"])


def _cycle(g, rng):
    a, b = rng.randrange(len(g.node)), rng.randrange(len(g.node))
    lo, hi = min(a, b), max(a, b)
    if g.node[lo].input:
        g.node[lo].input[0] = g.node[hi].output[0]  # reads what it (or a later node) writes


def _dtype(g, rng):
    rng.choice(list(g.input) + list(g.output)).type.tensor_type.elem_type = \
        rng.choice([0, 1, 2, 6, 7, 9, 10, 11, 16, 8, 30, 100])


def _attribute(g, rng):
    node = rng.choice(g.node)
    if node.attribute:
        a = rng.choice(node.attribute)
        if a.ints:
            a.ints[rng.randrange(len(a.ints))] = rng.choice(INTERESTING[:11] + [-2, 3])
        else:
            a.i = rng.choice(INTERESTING[:11] + [-2, 3])


def _initializer(g, rng):
    if g.initializer:
        t = rng.choice(g.initializer)
        if t.dims and rng.random() < 0.5:
            t.dims[rng.randrange(len(t.dims))] = rng.choice([0, 1, 3, 2**33, -1])
        else:
            t.data_type = rng.choice([1, 6, 7, 9, 11])


def _node(g, rng):
    i = rng.randrange(len(g.node))
    if rng.random() < 0.5:
        del g.node[i]
    else:
        g.node[i].op_type = rng.choice(["Relu", "Add", "Conv", "Reshape", "Transpose", "Gather",
                                        "Split", "NoSuchOp", "Loop", "MaxPool", "Einsum"])


GRAPH_MUTATIONS = [_rank, _dim, _dangling, _cycle, _dtype, _attribute, _initializer, _node]


# ---- one mutation --------------------------------------------------------------------------

def typed_errors() -> tuple:
    from compiler.errors import CompileError
    from runner.errors import BlobError, ConfigError, DeviceTimeout, InputError
    return BlobError, InputError, CompileError, ConfigError, DeviceTimeout


class Case:
    """The per-process fixed inputs of each kind: base blobs and their reference outputs."""

    def __init__(self, tmp: Path):
        from runner import Model
        self.tmp = tmp
        self.blob = base_blob(tmp).read_bytes()
        self.blob_feeds = {"x": np.random.default_rng(0).standard_normal((1, 3, 6, 6),
                                                                         dtype=np.float32)}
        self.blob_want = Model.load(tmp / "base.blob").run(self.blob_feeds)
        self.models = base_models()
        self._feeds_model = None

    def run(self, kind: str, seed: int, i: int) -> str:
        rng = random.Random(f"{seed}:{kind}:{i}")
        if kind.startswith("blob"):
            return self._blob(kind, rng)
        if kind == "feeds":
            return self._feeds(rng)
        if kind == "run-alias":
            return self._alias(rng)
        if kind == "run-events":
            return self._events(rng)
        return self._onnx(kind, rng)

    def _alias(self, rng: random.Random) -> str:
        from runner import Model
        from runner.errors import InputError
        if not hasattr(self, "alias_model"):
            write_model_blob(alias_model(), self.tmp / "alias.blob")
            self.alias_model = Model.load(self.tmp / "alias.blob")
        m = self.alias_model
        values = {n: np.random.default_rng(rng.randrange(2**32)).standard_normal(s)
                  .astype(np.float32) for n, (s, _) in m.inputs.items()}
        feeds, out, reads, arrays = alias_pattern(m, values, rng)
        want = m.run({n: np.ascontiguousarray(a).copy() for n, a in reads.items()})
        before = [a.copy() for a in arrays]
        try:
            got = m.run(feeds, out=out)
        except InputError:
            if not _shares(list(out.values())):
                return "WRONG InputError without two outputs in one array"
            if any((a != b).any() for a, b in zip(arrays, before)):
                return "WRONG a refused run wrote into an array"
            return "typed InputError"
        finally:
            for name in m.inputs:
                m.bind_input(name, None)
        if any(not np.array_equal(got[n], want[n]) for n in want):
            return "WRONG outputs differ from a run on copies"
        return "ok"

    def _events(self, rng: random.Random) -> str:
        if not hasattr(self, "event_blob"):
            self.event_blob = self.tmp / "events.blob"
            write_model_blob(event_model(), self.event_blob)
            self.other_blob = self.tmp / "other.blob"
            write_model_blob(event_model(scale=3), self.other_blob)
            self.event_x = np.random.default_rng(1).standard_normal((192, 192)).astype(np.float32)
            self.event_want = load_threads(self.event_blob, 1).run({"x0": self.event_x})["y"]
        event = rng.choice(EVENTS)
        return getattr(self, f"_event_{event}")(rng)

    def _right(self, m) -> bool:
        return bool((m.run({"x0": self.event_x})["y"] == self.event_want).all())

    def _event_interrupt(self, rng: random.Random) -> str:
        m = load_threads(self.event_blob, 2)
        timer = threading.Timer(rng.uniform(0, 0.003), os.kill, (os.getpid(), signal.SIGINT))
        try:
            timer.start()
            m.run({"x0": self.event_x})
            timer.join()  # the signal may land after run() returned
        except KeyboardInterrupt:
            pass
        timer.join()
        right = self._right(m)
        m.close()
        return "ok" if right else "WRONG a run after an interrupted one"

    def _event_close(self, rng: random.Random) -> str:
        from runner.errors import DeviceError
        m = load_threads(self.event_blob, 2)
        closer = threading.Timer(rng.uniform(0, 0.005), m.close)
        closer.start()
        try:
            for _ in range(100):
                if not self._right(m):
                    return "WRONG a run beside close()"
        except DeviceError as e:
            return "typed DeviceError" if "closed" in str(e) else f"WRONG {e}"
        finally:
            closer.join()
        return "ok"

    def _event_fork(self, rng: random.Random) -> str:
        from runner.errors import DeviceError
        m = load_threads(self.event_blob, rng.choice([1, 2]))
        pid = os.fork()
        if pid == 0:  # the child: a clear error at once, then a fresh load works
            try:
                m.run({"x0": self.event_x}, timeout_ms=10000)
                os._exit(3)
            except DeviceError:
                pass
            except BaseException:
                os._exit(4)
            os._exit(0 if self._right(load_threads(self.event_blob, 2)) else 5)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        right = self._right(m)
        m.close()
        return "ok" if status == 0 and right else f"WRONG fork: child exit {status}"

    def _event_file(self, rng: random.Random) -> str:
        path = self.tmp / "changing.blob"
        path.write_bytes(self.event_blob.read_bytes())
        m = load_threads(path, rng.choice([1, 2]))
        how = rng.choice(["truncate", "overwrite", "scribble", "replace", "unlink"])
        if how == "truncate":
            os.truncate(path, rng.randrange(path.stat().st_size))
        elif how == "overwrite":  # cp other.blob b.blob: the same inode
            with open(path, "r+b") as f:
                f.write(self.other_blob.read_bytes())
        elif how == "scribble":
            with open(path, "r+b") as f:
                f.seek(rng.randrange(path.stat().st_size))
                f.write(os.urandom(rng.randrange(1, 65536)))
        elif how == "replace":
            os.replace(_copy(self.other_blob, self.tmp / "new.blob"), path)
        else:
            path.unlink()
        right = self._right(m)
        m.close()
        return "ok" if right else f"WRONG after the file was changed ({how})"

    def _event_threads(self, rng: random.Random) -> str:
        m = load_threads(self.event_blob, rng.choice([1, 2]))
        results = []
        runners = [threading.Thread(target=lambda: results.append(self._right(m)))
                   for _ in range(rng.randrange(2, 5))]
        for t in runners:
            t.start()
        for t in runners:
            t.join()
        m.close()
        return "ok" if all(results) and len(results) == len(runners) else \
            "WRONG runs from several threads"

    def _blob(self, kind: str, rng: random.Random) -> str:
        from runner import Model
        path = self.tmp / "m.blob"
        data = mutate_blob(kind, self.blob, rng)
        if data == self.blob:
            return "unchanged"  # e.g. a field set to the value it had
        path.write_bytes(data)
        try:
            m = Model.load(path)
            if kind == "blob-manifest":
                return "loaded"  # resealed: its meaning may differ; loading must not crash
            got = m.run(self.blob_feeds)
        except typed_errors() as e:
            return f"typed {type(e).__name__}"
        if not _same(got, self.blob_want, 0, 0):
            return "WRONG accepted a changed blob and its outputs differ"
        return "ok"

    def _onnx(self, kind: str, rng: random.Random) -> str:
        import onnx
        from compiler.blob import write_blob
        from compiler.pipeline import compile_model
        from runner import Model
        data = mutate_onnx(kind, rng.choice(self.models), rng)
        path = self.tmp / "m.onnx"
        path.write_bytes(data)
        try:
            art = compile_model(str(path))
        except typed_errors() as e:
            return f"typed {type(e).__name__}"
        write_blob(art, self.tmp / "o.blob")
        m = Model.load(self.tmp / "o.blob")
        feeds = {n: _feed(np.random.default_rng(0), s, d) for n, (s, d) in m.inputs.items()}
        got = m.run(feeds)
        want = _ort(onnx.load_from_string(data), feeds)
        if want is None:
            return "compiled (onnxruntime refuses it)"
        if sorted(want) != sorted(got) or not _same(got, want, 1e-4, 1e-5):
            return "WRONG differs from onnxruntime"
        return "compiled, matches onnxruntime"

    def _feeds(self, rng: random.Random) -> str:
        from compiler.blob import write_blob
        from compiler.pipeline import compile_model
        from runner import Model
        from tests.test_hostile import assert_same_nonfinite, nan_feeds, nan_model, nan_want
        if self._feeds_model is None:
            model = nan_model()
            write_blob(compile_model(model), self.tmp / "nan.blob")
            self._feeds_model = model, Model.load(self.tmp / "nan.blob")
        model, m = self._feeds_model
        feeds = nan_feeds(rng.randrange(2**32))
        got, want = m.run(feeds), nan_want(model, feeds)
        for name, value in want.items():
            try:
                assert_same_nonfinite(got[name], value, name)
            except AssertionError:
                return f"WRONG {name} differs from onnxruntime"
        return "ok"


# ---- runs: aliasing and what happens around a run -------------------------------------------

EVENTS = ("interrupt", "close", "fork", "file", "threads")


def alias_model():
    """y0 = a @ w + b, y1 = a - b over (8, 8): y0 reads whole rows of a, so writing it into a
    while it runs would be wrong."""
    from onnx import helper
    from tests.graphs import make_model
    w = np.random.default_rng(2).standard_normal((8, 8)).astype(np.float32)
    return make_model([helper.make_node("MatMul", ["a", "w"], ["aw"]),
                       helper.make_node("Add", ["aw", "b"], ["y0"]),
                       helper.make_node("Sub", ["a", "b"], ["y1"])],
                      [("a", (8, 8), "float32"), ("b", (8, 8), "float32")],
                      [("y0", (8, 8), "float32"), ("y1", (8, 8), "float32")], {"w": w})


def event_model(scale: float = 2):
    """A MatMul long enough (a few ms at 2 threads) to be interrupted or closed mid-run; its
    weights are read from the blob on every run."""
    from tests.graphs import single_node_model
    w = np.full((192, 192), scale / 192, np.float32)
    return single_node_model("MatMul", [((192, 192), "float32"), w])


def write_model_blob(model, path: Path) -> None:
    from compiler.blob import write_blob
    from compiler.pipeline import compile_model
    write_blob(compile_model(model), path)


def load_threads(path: Path, threads: int):
    from tests.graphs import _load_at
    return _load_at(path, threads)


def _copy(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


def alias_pattern(m, values: dict, rng: random.Random) -> tuple:
    """(feeds or None, out, {input: what the run reads}, every array the run may write or read)
    for a random aliasing of outputs with feeds, slots, bound arrays and each other. Bound
    inputs may share memory: then they read the same values, as the reference does."""
    names = list(values)
    pool = np.zeros(4 * 64 + 16, np.float32)  # one buffer that several arrays overlap in
    via = rng.choice(["dict", "slots", "bound"])
    feeds, reads = None, {}
    for n in names:
        if via == "dict":
            arr = values[n].copy() if rng.random() < 0.7 else \
                np.asfortranarray(values[n])  # not contiguous: copied into its slot
            reads[n] = arr
        elif via == "slots":
            arr = m.input_view(n)
            arr[...] = values[n]
        else:
            at = rng.choice([0, 64, 128])
            arr = pool[at:at + 64].reshape(8, 8) if rng.random() < 0.5 else values[n].copy()
            arr[...] = values[n]
            m.bind_input(n, arr)
        reads.setdefault(n, arr)
    if via == "dict":
        feeds = reads
    out = {}
    for o in m.outputs:
        choice = rng.choice(["none", "fresh", "feed", "view", "slot", "pool"])
        if choice == "fresh":
            out[o] = np.zeros((8, 8), np.float32)
        elif choice == "feed" and reads[(n := rng.choice(names))].flags.c_contiguous:
            out[o] = reads[n]
        elif choice == "view":
            src = reads[rng.choice(names)]
            out[o] = src.view() if src.flags.c_contiguous else np.zeros((8, 8), np.float32)
        elif choice == "slot":
            out[o] = m.input_view(rng.choice(names))
        elif choice == "pool":
            at = rng.choice([0, 16, 64, 128, 192])
            out[o] = pool[at:at + 64].reshape(8, 8)
    return feeds, out, reads, [*out.values(), *reads.values(), pool]


def _shares(arrays: list) -> bool:
    return any(np.shares_memory(a, b) for i, a in enumerate(arrays) for b in arrays[i + 1:])


def _feed(rng, shape, dtype):
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(0, 3, shape).astype(dtype)


def _ort(model, feeds) -> dict | None:
    from tests.graphs import ort_run
    try:
        return ort_run(model, feeds)
    except Exception:  # onnxruntime's own untyped errors: it refuses the model or the feeds
        return None


def _same(got: dict, want: dict, rtol: float, atol: float) -> bool:
    for k, w in want.items():
        g = np.asarray(got[k])
        w = np.asarray(w)
        if g.shape != w.shape or not np.allclose(g.astype(np.float64), w.astype(np.float64),
                                                 rtol=rtol, atol=atol, equal_nan=True):
            return False
    return True


# ---- workers: each mutation batch in a subprocess, watched for crashes and hangs -------------

def worker(kind: str, seed: int, start: int, count: int) -> None:
    """Prints `<i> <outcome>` per mutation; an exception of the wrong type is an outcome too."""
    os.environ["KEEL_COMPILE_JOBS"] = "1"
    with tempfile.TemporaryDirectory(prefix="keel-fuzz-") as tmp:
        case = Case(Path(tmp))
        print("ready", flush=True)
        crash_at = os.environ.get("KEEL_FUZZ_CRASH_AT")  # tests the watchdog
        for i in range(start, start + count):
            if str(i) == crash_at:
                os.kill(os.getpid(), signal.SIGSEGV)
            try:
                out = case.run(kind, seed, i)
            except Exception as e:  # not a keel error: a failure, with what raised it
                out = f"UNTYPED {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            print(f"{i} {out}", flush=True)


def fuzz(kind: str, count: int, seed: int = 0, start: int = 0, batch: int = 500,
         log=None) -> dict:
    """Runs mutations [start, start+count) of `kind` in worker processes. Returns the tally:
    outcome -> count, plus 'failures': [(i, outcome)]."""
    deadline = DEADLINE_S[kind.split("-")[0]]
    tally, failures, i, end = {}, [], start, start + count
    while i < end:
        n = min(batch, end - i)
        done = _watch(kind, seed, i, n, deadline, tally, failures, log)
        i = done + 1  # past the last mutation answered, or past the one that crashed/hung
        if log:  # partial figures survive a run that is stopped
            log(f"{kind}: {i - start}/{count} so far: {tally}")
    tally["failures"] = failures
    return tally


def _watch(kind, seed, start, n, deadline, tally, failures, log) -> int:
    cmd = [sys.executable, "-m", "tests.fuzz_inputs", "--worker", kind, "--seed", str(seed),
           "--start", str(start), "--count", str(n)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=Path(__file__).parents[1])
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    last, budget = start - 1, 120.0  # the worker compiles its base models first
    cpu0, wall0 = _cpu_seconds(proc.pid), time.monotonic()
    while last < start + n - 1:
        line = proc.stdout.readline() if sel.select(1.0) else None
        if line is None:
            if _cpu_seconds(proc.pid) - cpu0 < budget and \
                    time.monotonic() - wall0 < WALL_FACTOR * budget:
                continue  # slow because the machine is loaded, not spinning: keep waiting
            proc.kill()
            proc.wait()
            return _fail(tally, failures, last + 1, "HANG", log)
        cpu0, wall0, budget = _cpu_seconds(proc.pid), time.monotonic(), deadline
        if not line:  # the worker died: the mutation after the last answered one crashed it
            proc.wait()
            return _fail(tally, failures, last + 1, f"CRASH (exit {proc.returncode})", log)
        if line.startswith("ready"):
            continue
        idx, outcome = line.rstrip("\n").split(" ", 1)
        last = int(idx)
        key = outcome.split(":")[0] if outcome.startswith("UNTYPED") else outcome
        tally[key] = tally.get(key, 0) + 1
        if outcome.startswith(("UNTYPED", "WRONG")):
            failures.append((last, outcome))
            if log:
                log(f"{kind} {last}: {outcome}")
    proc.wait()
    return last


def _cpu_seconds(pid: int) -> float:
    """CPU time of a worker and its finished children (clang): what a hang burns, whatever else
    the machine runs. 0 once it has exited (its end is seen on the pipe)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # u/s time, children's


def _fail(tally, failures, i, what, log) -> int:
    tally[what.split(" ")[0]] = tally.get(what.split(" ")[0], 0) + 1
    failures.append((i, what))
    if log:
        log(f"mutation {i}: {what}")
    return i


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blobs", type=int, default=0, help="blob mutations, split over 3 mutators")
    ap.add_argument("--onnx", type=int, default=0, help="ONNX mutations, split over 2 mutators")
    ap.add_argument("--feeds", type=int, default=0, help="random extreme feeds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", choices=KINDS)
    ap.add_argument("--kind", choices=KINDS, help="only this mutator (with --start/--count)")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--count", type=int, default=0)
    ap.add_argument("--json", help="write the tallies here")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.seed, args.start, args.count)
        return 0
    plan = {args.kind: args.count} if args.kind else {
        "blob-raw": args.blobs // 3, "blob-header": args.blobs // 3,
        "blob-manifest": args.blobs - 2 * (args.blobs // 3),
        "onnx-bytes": args.onnx // 2, "onnx-graph": args.onnx - args.onnx // 2,
        "feeds": args.feeds}
    report, bad = {}, 0
    for kind, n in plan.items():
        if not n:
            continue
        t = time.monotonic()
        tally = fuzz(kind, n, args.seed, args.start,
                     log=lambda s: print(s, file=sys.stderr, flush=True))
        secs = time.monotonic() - t
        report[kind] = {"mutations": n, "seconds": round(secs, 1),
                        "per_second": round(n / secs, 1), **tally}
        bad += len(tally["failures"])
        print(f"{kind}: {n} in {secs:.0f} s ({n / secs:.1f}/s): "
              f"{ {k: v for k, v in tally.items() if k != 'failures'} }", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
