"""The cDSP library (dsp/skel.c) and the host's reverse-RPC listener (dsp/listener.py), without a
device.

The skel is checked as the DSP's loader would see it, with llvm-readelf-19. The listener is
exercised through the same ioctl structs the driver takes: MockDsp stands in for fcntl.ioctl on
/dev/adsprpc-smd, as the msm-4.9 driver and a cDSP user PD answer it. When the host opens the skel
(remotectl open) or LOADs the programs, the mock's "loader" makes the reverse requests a PD makes
(apps_remotectl open of apps_std and apps_mem, stat, fopen_with_env, reads in chunks, a seek, a
re-read, fclose, a heap request), packed as quic/fastrpc's listener_buf.h packs them, delivered
to the listener's FASTRPC_IOCTL_INVOKE(handle 3, sc 0x04020200), and it checks that the bytes
served are the built skel's and the blob's programs'. What only a device proves (the real
loader's request sequence, the PD's acceptance of an unsigned library) is in docs/dsp.md.
"""
from __future__ import annotations

import ctypes
import errno
import re
import struct
import subprocess
import threading
import time

import pytest

from dsp import build, fastrpc, listener
from tests.deps import needs

READELF = "llvm-readelf-19"
ENTRY = "keel_dsp_skel_handle_invoke"
# what the skel imports from the PD, and why (dsp/skel.c): the programs are a second library
# (dlopen, dlsym, dlclose), the launch table is copied out of LOAD's buffer (malloc, free),
# clang calls memset for a struct cleared at once, and the workers are QuRT threads that sleep
# on futexes and hold HVX contexts (dsp/graph_runner.h, "Threads")
IMPORTS = {"dlopen", "dlsym", "dlclose", "malloc", "free", "memset", "qurt_thread_create",
           "qurt_futex_wait", "qurt_futex_wake", "qurt_hvx_lock", "qurt_hvx_unlock",
           "qurt_hvx_get_units"}
TOOLS = needs("clang-19, lld-19, llvm-19", build.missing(("clang-19", "ld.lld-19", READELF)))
PROGRAMS = b"\x7fELF programs stand-in: the mock compares bytes, it does not run them" * 50
CHUNK = 4096  # the mock loader's read size: the skel takes several reads
WAIT_S = 10.0  # the mock's bound on any wait (the real driver has none)
SKEL_HANDLE, VADDR, HEAP = 7, 0xd000_0000, 0xe000_0000


def _readelf(path, *flags) -> str:
    return subprocess.run([READELF, *flags, str(path)], capture_output=True, check=True,
                          text=True).stdout


@TOOLS
def test_the_skel_is_a_hexagon_v65_library_exporting_its_entry_with_4k_sections():
    so = build.skel_so()
    head = _readelf(so, "-h")
    assert re.search(r"Type:\s+DYN", head) and re.search(r"Machine:\s+Qualcomm Hexagon", head)
    assert re.search(r"Flags:\s+0x65\b", head)  # EF_HEXAGON_MACH_V65
    syms = [line.split() for line in _readelf(so, "--dyn-syms").splitlines()
            if re.match(r"\s*\d+:", line)]
    defined = {s[7] for s in syms if len(s) == 8 and s[6] != "UND"}
    undefined = {s[7] for s in syms if len(s) == 8 and s[6] == "UND"}
    assert ENTRY in defined and [s[3:5] for s in syms if s[-1] == ENTRY] == [["FUNC", "GLOBAL"]]
    assert undefined <= IMPORTS and {"dlopen", "dlsym"} <= undefined, undefined
    sections = re.findall(r"\]\s+(\.\S+)\s+\S+\s+[0-9a-f]{8} ([0-9a-f]{6}) [0-9a-f]{6} [0-9a-f]{2}"
                          r"\s+(\S*)\s+\d+\s+\d+\s+(\d+)", _readelf(so, "-S", "-W"))
    loaded = [(name, int(off, 16), int(al)) for name, off, flags, al in sections if "A" in flags]
    assert {".text", ".dynamic", ".dynsym", ".got"} <= {n for n, _, _ in loaded}
    assert all(al == 4096 and off % 4096 == 0 for _, off, al in loaded), loaded
    assert not {".gnu.hash", ".comment"} & {n for n, *_ in sections}
    assert "TEXTREL" not in _readelf(so, "-d")


def test_requests_are_unpacked_and_answers_packed_as_listener_buf_h_does():
    # in buffers "abc" and "" then two out lengths: "abc" is 8-aligned, the empty one is not,
    # each length sits where the previous buffer ended
    req = struct.pack("<I", 3) + bytes(4) + b"abc" + struct.pack("<I", 0) + \
        struct.pack("<2I", 8, 5)
    assert listener.unpack_request(req, listener.scalars(9, 2, 2)) == ([b"abc", b""], [8, 5])
    assert listener.pack_answer([b"", b"xy"]) == struct.pack("<2I", 0, 2) + b"xy"
    assert listener.pack_answer([b"x", b"yz"]) == struct.pack("<I", 1) + bytes(4) + b"x" + \
        struct.pack("<I", 2) + bytes(3) + b"yz"
    with pytest.raises(fastrpc.DeviceError, match="runs past the 10-byte request"):
        listener.unpack_request(req[:10], listener.scalars(9, 1, 0))


def test_the_listener_seeks_reads_to_eof_and_refuses_what_it_cannot_serve():
    served = listener.Listener(None, None, {"lib.so": b"0123456789"})

    def ask(sc, ins, outs):
        result, answer = served._answer(sc, _pack(ins, outs), len(_pack(ins, outs)))
        return result, (None if result else _unpack(answer, outs))

    strings = [b"ADSP_LIBRARY_PATH\0", b";\0", b"/some/dir/lib.so\0", b"r\0"]
    _, (fd,) = ask(listener.FOPEN, [struct.pack("<4I", *map(len, strings)), *strings], [4])
    fd = struct.unpack("<I", fd)[0]
    assert ask(listener.FSEEK, [struct.pack("<Iii", fd, -3, listener.SEEK_END)], []) == (0, [])
    _, (head, data) = ask(listener.FREAD, [struct.pack("<2I", fd, 8)], [8, 8])
    assert struct.unpack("<2I", head) == (3, 1) and data[:3] == b"789"  # short read: EOF
    assert ask(listener.FSEEK, [struct.pack("<Iii", fd, -1, listener.SEEK_SET)], [])[0]
    assert ask(listener.FCLOSE, [struct.pack("<I", fd)], []) == (0, [])
    assert ask(listener.FCLOSE, [struct.pack("<I", fd)], [])[0]  # closed twice: refused
    assert served.error is None
    assert served._answer(listener.FREAD, b"", listener.CAPACITY + 1) == (listener.FAIL, b"")
    assert "more than the listener's 65536" in str(served.error)


# ---- the mock driver and PD ---------------------------------------------------------------------

def _pack(ins: list[bytes], outs: list[int]) -> bytes:
    """The DSP side's packing of a reverse request (pack_in_bufs, pack_out_lens)."""
    out = b""
    for b in ins:
        out += struct.pack("<I", len(b))
        out = out.ljust(-(-len(out) // 8) * 8, b"\0") + b if b else out
    return out + struct.pack(f"<{len(outs)}I", *outs)


def _unpack(data: bytes, outs: list[int]) -> list[bytes]:
    """The DSP side's unpack_out_bufs: every length must be the one asked for."""
    got, at = [], 0
    for n in outs:
        (k,) = struct.unpack_from("<I", data, at)
        assert k == n, f"answer length {k}, asked {n}"
        at = -(-(at + 4) // 8) * 8 if n else at + 4
        got.append(data[at:at + n])
        at += n
    return got


def _arg(pra, i: int) -> bytes:
    b = pra[i].buf
    return ctypes.string_at(b.pv, b.len) if b.len else b""


class Pd:
    """One user PD's side of a session: the listener's state and the reverse requests queued."""

    def __init__(self):
        self.queue, self.answers, self.listening, self.exited = [], {}, False, False


class MockDsp:
    """fcntl.ioctl for the FastRPC node, a PD per session fd (INIT_ATTRS). `ask` overrides the
    library name the loader fopens; `rogue` is a reverse sc the loader sends first (one keel does
    not serve)."""

    def __init__(self, skel: bytes, refuse_unsigned=False, ask=None, rogue=None):
        self.skel, self.refuse, self.ask, self.rogue = skel, refuse_unsigned, ask, rogue
        self.calls, self.reverse_scs, self.served, self.heap = [], [], {}, []
        self.cond = threading.Condition()
        self.pds: dict[int, Pd] = {}
        self.ctx = self.sessions = 0

    def __call__(self, fd, number, arg):
        if number == fastrpc.INVOKE:
            self.calls.append((number, arg.handle, arg.sc))
            return self._invoke(self.pds[fd], arg)
        self.calls.append((number, arg))
        if number == fastrpc.INIT_ATTRS:
            if self.refuse:
                raise OSError(errno.EPERM, "Operation not permitted")
            assert arg.init.flags == fastrpc.FASTRPC_INIT_CREATE
            self.pds[fd], self.sessions = Pd(), self.sessions + 1
        elif number == fastrpc.MMAP:
            assert fd in self.pds, "MMAP before the PD exists"
            if arg.fd == -1:
                self.heap.append(arg.size)
            arg.vaddrout = HEAP if arg.fd == -1 else VADDR

    def _invoke(self, pd: Pd, arg):
        key = (arg.handle, arg.sc)
        if key == (listener.LISTENER, listener.INIT2):
            assert not pd.listening
            pd.listening = True
        elif key == (listener.LISTENER, listener.NEXT2):
            self._next2(pd, arg.pra)
        elif key == (listener.CURRENT_PROCESS, listener.EXIT):
            with self.cond:
                pd.exited = True
                self.cond.notify_all()
        elif key == (0, fastrpc.scalars(0, 2, 2)):
            self._open_skel(pd, arg.pra)
        elif key == (SKEL_HANDLE, fastrpc.scalars(fastrpc.LOAD, 3, 1)):
            self._load(pd, arg.pra)
        elif key == (SKEL_HANDLE, fastrpc.scalars(fastrpc.RUN, 1, 1)):
            seq, _, _, _, patches = struct.unpack_from("<5I", _arg(arg.pra, 0))
            assert len(_arg(arg.pra, 0)) == 20 + 8 * patches  # dsp/graph_runner.h's Request
            ctypes.memmove(arg.pra[1].buf.pv, struct.pack("<4I", seq, 0, 0, 0), 16)
        else:
            raise OSError(errno.EINVAL, f"no such handle/method {key}")

    def _next2(self, pd: Pd, pra):
        """The listener's turn: take its answer to the last request, hand it the next one."""
        assert pd.listening, "next2 before init2"
        ctx, result, n, cap = struct.unpack("<4I", _arg(pra, 0))
        assert pra[1].buf.len == n and pra[3].buf.len == cap and pra[2].buf.len == 16
        with self.cond:
            if ctx:
                pd.answers[ctx] = (result, _arg(pra, 1))
                self.cond.notify_all()
            if not self.cond.wait_for(lambda: pd.queue or pd.exited, WAIT_S):
                raise OSError(errno.ETIMEDOUT, "mock: no request")
            if pd.exited:
                raise OSError(errno.ECONNRESET, "mock: the PD exited")
            ctx, handle, sc, payload = pd.queue.pop(0)
        ctypes.memmove(pra[2].buf.pv, struct.pack("<4I", ctx, handle, sc, len(payload)), 16)
        if len(payload) <= cap:
            ctypes.memmove(pra[3].buf.pv, payload, len(payload))

    def reverse(self, pd: Pd, handle: int, sc: int, ins: list[bytes], outs: list[int]):
        """One request to the host, as the PD makes it: (result, out buffers or None)."""
        assert (sc >> 16 & 0xff, sc >> 8 & 0xff) == (len(ins), len(outs))
        self.reverse_scs.append(sc)
        with self.cond:
            self.ctx += 1
            ctx = self.ctx
            pd.queue.append((ctx, handle, sc, _pack(ins, outs)))
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: ctx in pd.answers, WAIT_S):
                raise OSError(errno.ETIMEDOUT, f"mock: the host never answered sc {sc:#x}")
            result, data = pd.answers.pop(ctx)
        return result, (None if result else _unpack(data, outs))

    def _interface(self, pd: Pd, name: str) -> int:
        ins = [struct.pack("<2I", len(name) + 1, 64), name.encode() + b"\0"]
        _, (out, _) = self.reverse(pd, 0, listener.OPEN, ins, [8, 64])
        handle, err = struct.unpack("<Ii", out)
        assert not err and handle, name
        return handle

    def read_library(self, pd: Pd, name: str) -> bytes | None:
        """The loader's reads: stat, fopen through ADSP_LIBRARY_PATH, chunks, seek, close."""
        std = self._interface(pd, "apps_std")
        strings = [b"ADSP_LIBRARY_PATH\0", b";\0", name.encode() + b"\0", b"r\0"]
        res, outs = self.reverse(pd, std, listener.FOPEN,
                                 [struct.pack("<4I", *map(len, strings)), *strings], [4])
        if res:
            return None
        (fd,) = struct.unpack("<I", outs[0])
        _, (st,) = self.reverse(pd, std, listener.STAT,
                                [struct.pack("<I", len(name) + 1), name.encode() + b"\0"], [0x60])
        size = struct.unpack_from("<Q", st, 40)[0]
        data, eof = b"", 0
        while not eof:
            _, (head, chunk) = self.reverse(pd, std, listener.FREAD,
                                            [struct.pack("<2I", fd, CHUNK)], [8, CHUNK])
            n, eof = struct.unpack("<2I", head)
            data += chunk[:n]
        assert len(data) == size
        assert self.reverse(pd, std, listener.FSEEK, [struct.pack("<Iii", fd, 0, 0)], [])[0] == 0
        _, (head, again) = self.reverse(pd, std, listener.FREAD, [struct.pack("<2I", fd, 52)],
                                        [8, 52])
        assert again == data[:52]  # the ELF header, read again after the seek
        assert self.reverse(pd, std, listener.FCLOSE, [struct.pack("<I", fd)], [])[0] == 0
        return data

    def _open_skel(self, pd: Pd, pra):
        n, errlen = struct.unpack("<2I", _arg(pra, 0))
        uri = _arg(pra, 1)
        assert len(uri) == n and uri.endswith(b"\0")
        name, symbol = re.fullmatch(rb"file:///([^?]+)\?([^&]+)&.*\0", uri).groups()
        if self.rogue is not None:
            self.reverse(pd, self._interface(pd, "apps_std"), self.rogue, [], [])
        data = self.read_library(pd, self.ask or name.decode())
        mem = self._interface(pd, "apps_mem")  # the PD grows its heap for the library
        _, (vaddr,) = self.reverse(pd, mem, listener.MEM_MAP,
                                   [struct.pack("<iIIIqq", -1, 0, 0, 0, 0, 1 << 20)], [16])
        assert struct.unpack("<2Q", vaddr)[1] == HEAP
        ok = data == self.skel and b"\0" + symbol + b"\0" in data
        if ok:
            self.served[name.decode()] = data
        out = struct.pack("<Ii", SKEL_HANDLE, 0) if ok else struct.pack("<2I", 0, 0x80000406)
        ctypes.memmove(pra[2].buf.pv, out, 8)
        ctypes.memmove(pra[3].buf.pv, b"no such library\0" if not ok else b"\0", 16)

    def _load(self, pd: Pd, pra):
        head, name, table = _arg(pra, 0), _arg(pra, 1), _arg(pra, 2)
        vaddr, size, weights, arena, nslots = struct.unpack_from("<5I", head)
        assert vaddr == VADDR and len(head) == 4 * (5 + nslots) and len(table) % 4 == 0
        data = self.read_library(pd, name.rstrip(b"\0").decode())
        self.served[name.rstrip(b"\0").decode()] = data
        status = 0 if data == PROGRAMS else 2  # dsp/skel.c NO_LIBRARY
        ctypes.memmove(pra[3].buf.pv, struct.pack("<i", status), 4)


class FakeShm:
    """Where fastrpc.Ion would be: an ION buffer's fd, address and size."""
    fd, addr, nbytes = 99, 0x7000_0000, 4096

    def close(self):
        self.closed = True


@pytest.fixture
def device_files(tmp_path, monkeypatch):
    """A FastRPC node and a DSP shell where the transport looks for them; the skel is the one
    dsp/build.py builds, which the transport builds too (KEEL_DSP_SKEL unset)."""
    node, shell = tmp_path / "adsprpc-smd", tmp_path / "fastrpc_shell_3"
    node.write_bytes(b"")
    shell.write_bytes(b"\x7fELF" + bytes(60))
    monkeypatch.setattr(fastrpc, "RPC_NODE", str(node))
    monkeypatch.setattr(fastrpc, "SHELLS", (str(shell),))
    monkeypatch.delenv("KEEL_DSP_SKEL", raising=False)
    return build.skel_so().read_bytes()


def transport(kernel, monkeypatch):
    monkeypatch.setattr(fastrpc.fcntl, "ioctl", kernel)
    t = fastrpc.FastRpcTransport()
    t.shm = FakeShm()
    return t


@TOOLS
def test_opening_serves_the_skel_and_the_programs_through_the_listener(device_files,
                                                                        monkeypatch):
    kernel = MockDsp(device_files)
    t = transport(kernel, monkeypatch)
    t.open(PROGRAMS, 0, 128, [256], struct.pack("<2I", 1, 0), time.monotonic() + WAIT_S)
    assert kernel.served == {fastrpc.SKEL: device_files, fastrpc.PROGRAMS: PROGRAMS}
    assert len(device_files) > 4 * CHUNK  # served in several reads
    assert kernel.heap == [1 << 20]  # the apps_mem request became a heap MMAP (fd -1)
    invokes = [c[1:] for c in kernel.calls if c[0] == fastrpc.INVOKE]
    assert invokes[0] == (3, 0x03000000)  # init2 before anything reaches the DSP
    assert set(invokes) >= {(3, 0x04020200), (0, 0x00020200),
                            (SKEL_HANDLE, fastrpc.scalars(fastrpc.LOAD, 3, 1))}
    assert {0x13050100, 0x04010200, 0x09010000, 0x03010000, 0x1f020100, 0x02010100} <= \
        set(kernel.reverse_scs)
    assert t.listener.error is None and t.listener.unserved == []
    t.invoke(1, struct.pack("<5I", 1, 0, 0, 1, 0))  # seq 1, no flags, launch 0, no patches
    deadline, got = time.monotonic() + WAIT_S, []
    while not got and time.monotonic() < deadline:
        t.block(0.05)
        got = t.replies()
    assert got == [(1, 0, [])]
    first, pd = t.listener.thread, kernel.pds[t.rpc]
    kernel.served.clear()
    t.restart(time.monotonic() + WAIT_S)  # recover(): the PD exits, a new one loads again
    first.join(WAIT_S)
    assert pd.exited and not first.is_alive()  # the PD's exit ended the listener's wait
    assert kernel.sessions == 2 and kernel.served == {fastrpc.SKEL: device_files,
                                                      fastrpc.PROGRAMS: PROGRAMS}
    second, pd = t.listener.thread, kernel.pds[t.rpc]
    t.close()
    second.join(WAIT_S)
    assert pd.exited and not second.is_alive()


@TOOLS
def test_a_request_the_listener_cannot_serve_is_a_device_error(device_files, monkeypatch):
    rogue = listener.scalars(30, 0, 0)
    t = transport(MockDsp(device_files, rogue=rogue), monkeypatch)
    with pytest.raises(fastrpc.DeviceError, match=f"does not serve: sc {rogue:#010x} "
                                                  r"\(method 30, 0 in, 0 out"):
        t.open(PROGRAMS, 0, 128, [256], b"", time.monotonic() + WAIT_S)
    t.close()


@TOOLS
def test_a_library_keel_does_not_hold_is_answered_missing_and_named(device_files, monkeypatch):
    t = transport(MockDsp(device_files, ask="libother.so"), monkeypatch)
    with pytest.raises(fastrpc.DeviceError, match=r"could not open libkeel_dsp_skel.so .*no such "
                                                  r"library.*files keel does not hold: "
                                                  r"\['libother.so'\]"):
        t.open(PROGRAMS, 0, 128, [256], b"", time.monotonic() + WAIT_S)
    t.close()


@TOOLS
def test_served_bytes_must_be_the_skel_or_the_load_fails(device_files, monkeypatch):
    kernel = MockDsp(device_files + b"x")  # the PD expected other bytes: they must match
    t = transport(kernel, monkeypatch)
    with pytest.raises(fastrpc.DeviceError, match="could not open libkeel_dsp_skel.so"):
        t.open(PROGRAMS, 0, 128, [256], b"", time.monotonic() + WAIT_S)
    assert kernel.served == {}
    t.close()


@TOOLS
def test_a_device_refusing_unsigned_pds_gets_a_test_signature_error(device_files, monkeypatch):
    kernel = MockDsp(device_files, refuse_unsigned=True)
    t = transport(kernel, monkeypatch)
    with pytest.raises(fastrpc.DeviceError, match="refused an unsigned protection domain .* "
                                                  "needs a test signature"):
        t.open(PROGRAMS, 0, 128, [256], b"", time.monotonic() + 5)
    (getinfo, _), (init, attrs) = kernel.calls
    assert (getinfo, init) == (fastrpc.GETINFO, fastrpc.INIT_ATTRS)
    assert attrs.attrs == fastrpc.UNSIGNED_PD and attrs.init.filelen == 64
    t.close()
