"""The host side of FastRPC's reverse RPC: the thread that answers the cDSP's requests to the host
while keel's library loads. A user PD has no file system; its loader reads a library named in an
open URI (`file:///libkeel_dsp_skel.so?...`) through the apps_std interface of the process that
created the PD, by invoking the host. That process serves those calls with one thread blocked in
the adsp_listener interface (handle 3 on its FastRPC fd):

  init2  FASTRPC_IOCTL_INVOKE(handle 3, method 3, no buffers), once;
  next2  FASTRPC_IOCTL_INVOKE(handle 3, method 4, 2 in 2 out), in a loop. In: {ctx, result,
         answer bytes, request capacity} and the answer to the previous request (ctx 0 at
         first); out: {ctx, handle, sc, request bytes} and the next request.

A request's bytes (listener_buf.h in quic/fastrpc): per in buffer its u32 length (where the
previous one ended, unaligned) and, if not empty, padding to 8 and its bytes; then per out buffer
its u32 length. An answer: per out buffer its u32 length and, if not empty, padding to 8 and its
bytes: exactly the requested length (the DSP side checks it). A failed request is answered with
a non-zero result and no bytes.

What is served, by sc (REMOTE_SCALARS_MAKE; the values tinygrad's runtime/ops_dsp.py answers on
the comma 3X), only from memory: the files keel hands over (the skel and the programs), never the
host's file system:
  apps_remotectl open  0x00020200  an interface on the host by name: apps_std, apps_mem
  apps_std fopen       0x13050100  fopen_with_env(env var, delimiter, name, mode) -> fd
  apps_std fclose      0x03010000
  apps_std fread       0x04010200  (fd, bytes) -> (read, eof), the bytes
  apps_std fseek       0x09010000  (fd, offset, whence)
  apps_std stat        0x1f020100  path -> apps_std_STAT (0x60 bytes: size, mode, nlink set)
  apps_mem map         0x02010100  heap for the PD: FASTRPC_IOCTL_MMAP(fd -1) -> DSP address
Anything else is answered with a failure and becomes the DeviceError the session raises; a file
the DSP asks for that keel does not hold is answered "no such file" (the loader may probe) and is
named in the error if the load then fails.
"""
from __future__ import annotations

import struct
import threading

from runner.errors import DeviceError

LISTENER = 3  # the adsp_listener interface's static handle
CURRENT_PROCESS = 4  # adsp_current_process: its method 2 (exit) ends the PD, and next2 with it


def scalars(method: int, ins: int, outs: int) -> int:
    """REMOTE_SCALARS_MAKE: which method, how many in and out buffers."""
    return (method & 0x1f) << 24 | (ins & 0xff) << 16 | (outs & 0xff) << 8


INIT2, NEXT2, EXIT = scalars(3, 0, 0), scalars(4, 2, 2), scalars(2, 0, 0)
OPEN, FOPEN, FCLOSE = scalars(0, 2, 2), scalars(19, 5, 1), scalars(3, 1, 0)
FREAD, FSEEK, STAT, MEM_MAP = scalars(4, 1, 2), scalars(9, 1, 0), scalars(31, 2, 1), \
    scalars(2, 1, 1)
INTERFACES = {"apps_std": 0x5354_4400, "apps_mem": 0x4d45_4d00}  # host handles we answer with
CAPACITY = 1 << 16  # request bytes per next2 (tinygrad's; the loader's requests are small)
FAIL = 1  # a non-zero AEE result
SEEK_SET, SEEK_CUR, SEEK_END = 0, 1, 2
S_IFREG = 0o100444  # a regular file, read-only
FIRST_FD = 0x100


def _up8(n: int) -> int:
    return -(-n // 8) * 8


def unpack_request(data: bytes, sc: int) -> tuple[list[bytes], list[int]]:
    """A request's in buffers and its out buffers' lengths."""
    ins, at = [], 0
    for _ in range((sc >> 16) & 0xff):
        (n,) = struct.unpack_from("<I", data, at)
        at = _up8(at + 4) if n else at + 4
        if at + n > len(data):
            raise DeviceError(f"reverse RPC sc {sc:#010x}: an in buffer of {n} bytes runs past "
                              f"the {len(data)}-byte request")
        ins.append(bytes(data[at:at + n]))
        at += n
    lens = list(struct.unpack_from(f"<{(sc >> 8) & 0xff}I", data, at))
    return ins, lens


def pack_answer(outs: list[bytes]) -> bytes:
    """Per out buffer its u32 length, then (if not empty) padding to 8 and its bytes."""
    out = b""
    for b in outs:
        out += struct.pack("<I", len(b))
        if b:
            out = out.ljust(_up8(len(out)), b"\0") + b
    return out


def _cstr(b: bytes) -> str:
    return b.split(b"\0", 1)[0].decode(errors="replace")


class Listener:
    """Serves `files` ({name: bytes}) to the DSP of one session. `invoke(handle, sc, ins, outs,
    what)` is a FASTRPC_IOCTL_INVOKE on that session's fd returning the out buffers' bytes
    (DeviceError on failure); `heap(flags, size)` maps PD heap and returns its DSP address."""

    def __init__(self, invoke, heap, files: dict[str, bytes]):
        self.invoke, self.heap, self.files = invoke, heap, dict(files)
        self.open_files: dict[int, list] = {}  # fd -> [name, position]
        self.unserved: list[str] = []  # names asked for that keel does not hold
        self.error: DeviceError | None = None  # a request keel cannot serve
        self.stopped = False
        self.thread = None

    def start(self) -> None:
        """init2 on the caller's thread (a refusal is the caller's DeviceError), then next2 in a
        daemon thread: it blocks in the driver until the DSP asks, or the PD exits."""
        self.invoke(LISTENER, INIT2, [], [], "starting the reverse-RPC listener")
        self.thread = threading.Thread(target=self._loop, daemon=True, name="keel-listener")
        self.thread.start()

    def why(self) -> str:
        """What the DSP asked for that keel did not serve, for the session's error."""
        if self.error:
            return f"; {self.error}"
        return f"; the DSP asked for files keel does not hold: {self.unserved}" \
            if self.unserved else ""

    def _loop(self) -> None:
        ctx, result, answer = 0, 0xffffffff, b""
        while not self.stopped:
            head = struct.pack("<4I", ctx, result, len(answer), CAPACITY)
            try:
                got, req = self.invoke(LISTENER, NEXT2, [head, answer], [16, CAPACITY],
                                       "waiting for the DSP's next request")
            except DeviceError as e:
                if not self.stopped and self.error is None:
                    self.error = e
                return  # the PD exited (or the session was closed): nothing more to serve
            ctx, handle, sc, need = struct.unpack("<4I", got)
            result, answer = self._answer(sc, req, need)

    def _answer(self, sc: int, req: bytes, need: int) -> tuple[int, bytes]:
        if need > CAPACITY:
            return self._refuse(f"a reverse-RPC request of {need} bytes (sc {sc:#010x}), more "
                                f"than the listener's {CAPACITY}")
        serve = {OPEN: self._open, FOPEN: self._fopen, FCLOSE: self._fclose, FREAD: self._fread,
                 FSEEK: self._fseek, STAT: self._stat, MEM_MAP: self._map}.get(sc)
        if serve is None:
            return self._refuse(f"the DSP made a reverse-RPC request keel's listener does not "
                                f"serve: sc {sc:#010x} (method {sc >> 24 & 0x1f}, "
                                f"{sc >> 16 & 0xff} in, {sc >> 8 & 0xff} out buffers)")
        try:
            ins, lens = unpack_request(req[:need], sc)
            outs = serve(ins, lens)
        except (struct.error, IndexError, DeviceError) as e:
            return self._refuse(f"a malformed reverse-RPC request, sc {sc:#010x}: {e}")
        if outs is None:
            return FAIL, b""
        return 0, pack_answer([o[:n].ljust(n, b"\0") for o, n in zip(outs, lens)])

    def _refuse(self, what: str) -> tuple[int, bytes]:
        if self.error is None:
            self.error = DeviceError(what)
        return FAIL, b""

    def _open(self, ins, lens):
        name = _cstr(ins[1])
        if name not in INTERFACES:
            self.unserved.append(f"interface {name}")
            return [struct.pack("<Ii", 0, -1), f"keel serves no {name}".encode()]
        return [struct.pack("<Ii", INTERFACES[name], 0), b""]

    def _fopen(self, ins, lens):
        name = _cstr(ins[3]).rsplit("/", 1)[-1]  # the loader may prefix a library path entry
        if name not in self.files:
            self.unserved.append(name)
            return None
        fd = FIRST_FD + len(self.open_files)
        while fd in self.open_files:
            fd += 1
        self.open_files[fd] = [name, 0]
        return [struct.pack("<I", fd)]

    def _fclose(self, ins, lens):
        (fd,) = struct.unpack_from("<I", ins[0])
        return [] if self.open_files.pop(fd, None) else None

    def _fread(self, ins, lens):
        fd, want = struct.unpack_from("<2I", ins[0])
        f = self.open_files.get(fd)
        if f is None:
            return None
        data = self.files[f[0]][f[1]:f[1] + min(want, lens[1])]
        f[1] += len(data)
        return [struct.pack("<2I", len(data), int(len(data) < want)), data]

    def _fseek(self, ins, lens):
        fd, offset, whence = struct.unpack_from("<Iii", ins[0])
        f = self.open_files.get(fd)
        if f is None or whence not in (SEEK_SET, SEEK_CUR, SEEK_END):
            return None
        base = {SEEK_SET: 0, SEEK_CUR: f[1], SEEK_END: len(self.files[f[0]])}[whence]
        if base + offset < 0:
            return None
        f[1] = base + offset
        return []

    def _stat(self, ins, lens):
        name = _cstr(ins[1]).rsplit("/", 1)[-1]
        if name not in self.files:
            self.unserved.append(name)
            return None
        # apps_std_STAT: tsz, dev, ino (u64), mode, nlink (u32), rdev, size (u64), then times
        return [struct.pack("<3Q2I2Q", 0, 0, 0, S_IFREG, 1, 0, len(self.files[name]))]

    def _map(self, ins, lens):
        # apps_mem_request_map64: heapid, lflags, rflags (u32), pad, vin, len (u64)
        _, _, rflags, _, _, size = struct.unpack_from("<4I2Q", ins[0])
        return [struct.pack("<2Q", 0, self.heap(rflags, size))]

    def stop(self) -> None:
        self.stopped = True
