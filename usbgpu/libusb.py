"""libusb-1.0 through cffi (ABI mode: no compiler needed at run time), and `Usb`: one opened
device whose bulk transfers (with USB3 stream ids) run as one batch under a deadline.

The declarations are libusb.h's (libusb 1.0.19 and later: bulk streams); the library is Debian's
libusb-1.0-0 on Linux and Homebrew's libusb on macOS. tests/test_usbgpu_libusb.py compiles the
header's struct libusb_transfer with clang and checks cffi's layout against it.

`lib` is pluggable like qcom/kgsl.py's ioctl entry point: the real library, or
sim/usb/mock.py's MockLibusb (KEEL_USB=mock), which implements the same functions over the same
struct libusb_transfer bytes. Every call that can fail raises DeviceError naming the call and
libusb's error name; every transfer carries a timeout, and a batch that is not done by its
deadline is cancelled and reported, never waited on forever.
"""
from __future__ import annotations

import platform
import time

from cffi import FFI

from runner.errors import DeviceError

CDEF = """
typedef struct libusb_context libusb_context;
typedef struct libusb_device_handle libusb_device_handle;
struct libusb_iso_packet_descriptor {
    unsigned int length; unsigned int actual_length; int status;
};
struct libusb_transfer;
typedef void (*libusb_transfer_cb_fn)(struct libusb_transfer *transfer);
struct libusb_transfer {
    libusb_device_handle *dev_handle;
    uint8_t flags;
    unsigned char endpoint;
    unsigned char type;
    unsigned int timeout;
    int status;
    int length;
    int actual_length;
    libusb_transfer_cb_fn callback;
    void *user_data;
    unsigned char *buffer;
    int num_iso_packets;
    struct libusb_iso_packet_descriptor iso_packet_desc[];
};
struct timeval { long tv_sec; long tv_usec; };
int libusb_init(libusb_context **ctx);
void libusb_exit(libusb_context *ctx);
libusb_device_handle *libusb_open_device_with_vid_pid(libusb_context *ctx, uint16_t vendor_id,
                                                      uint16_t product_id);
void libusb_close(libusb_device_handle *dev_handle);
int libusb_kernel_driver_active(libusb_device_handle *dev_handle, int interface_number);
int libusb_detach_kernel_driver(libusb_device_handle *dev_handle, int interface_number);
int libusb_set_configuration(libusb_device_handle *dev_handle, int configuration);
int libusb_claim_interface(libusb_device_handle *dev_handle, int interface_number);
int libusb_release_interface(libusb_device_handle *dev_handle, int interface_number);
int libusb_set_interface_alt_setting(libusb_device_handle *dev_handle, int interface_number,
                                     int alternate_setting);
int libusb_clear_halt(libusb_device_handle *dev_handle, unsigned char endpoint);
int libusb_alloc_streams(libusb_device_handle *dev_handle, uint32_t num_streams,
                         unsigned char *endpoints, int num_endpoints);
int libusb_free_streams(libusb_device_handle *dev_handle, unsigned char *endpoints,
                        int num_endpoints);
struct libusb_transfer *libusb_alloc_transfer(int iso_packets);
void libusb_free_transfer(struct libusb_transfer *transfer);
int libusb_submit_transfer(struct libusb_transfer *transfer);
int libusb_cancel_transfer(struct libusb_transfer *transfer);
void libusb_transfer_set_stream_id(struct libusb_transfer *transfer, uint32_t stream_id);
int libusb_handle_events_timeout_completed(libusb_context *ctx, struct timeval *tv,
                                           int *completed);
const char *libusb_error_name(int errcode);
"""
ffi = FFI()
ffi.cdef(CDEF)

TRANSFER_BULK, TRANSFER_BULK_STREAM = 2, 4  # enum libusb_transfer_type
COMPLETED, ERROR, TIMED_OUT, CANCELLED, STALL, NO_DEVICE, OVERFLOW = range(7)
STATUS = ("completed", "error", "timed out", "cancelled", "stall", "no device", "overflow")
PENDING = -1  # our marker in `status` until libusb's completion writes the real one
ERROR_NO_DEVICE = -4
ERROR_NAMES = {-1: "LIBUSB_ERROR_IO", -2: "LIBUSB_ERROR_INVALID_PARAM", -3: "LIBUSB_ERROR_ACCESS",
               -4: "LIBUSB_ERROR_NO_DEVICE", -5: "LIBUSB_ERROR_NOT_FOUND", -6: "LIBUSB_ERROR_BUSY",
               -7: "LIBUSB_ERROR_TIMEOUT", -9: "LIBUSB_ERROR_PIPE",
               -12: "LIBUSB_ERROR_NOT_SUPPORTED"}
# where the library lives: Debian's soname, Homebrew's prefixes (Apple silicon, then Intel)
CANDIDATES = {"Linux": ("libusb-1.0.so.0",),
              "Darwin": ("/opt/homebrew/lib/libusb-1.0.0.dylib",
                         "/usr/local/lib/libusb-1.0.0.dylib")}


def load():
    """The system's libusb-1.0; DeviceError saying what to install when it is missing."""
    tried = CANDIDATES.get(platform.system(), ("libusb-1.0.so.0",))
    for name in tried:
        try:
            return ffi.dlopen(name)
        except OSError:
            continue
    how = "brew install libusb" if platform.system() == "Darwin" else \
        "apt-get install libusb-1.0-0"
    raise DeviceError(f"libusb-1.0 not found (tried {', '.join(tried)}); install it: {how}")


def check(rc: int, what: str) -> int:
    if rc < 0:
        raise DeviceError(f"{what}: {ERROR_NAMES.get(rc, f'libusb error {rc}')}")
    return rc


class Usb:
    """One opened USB device, interface 0 claimed in `alt` with bulk streams on `stream_eps`."""

    def __init__(self, lib, vid: int, pid: int, alt: int, stream_eps: tuple[int, ...],
                 streams: int):
        self.lib, self.handle, self.ctx = lib, ffi.NULL, ffi.NULL
        ctx = ffi.new("libusb_context **")
        check(lib.libusb_init(ctx), "libusb_init")
        self.ctx = ctx[0]
        self.handle = lib.libusb_open_device_with_vid_pid(self.ctx, vid, pid)
        if self.handle == ffi.NULL:
            self.close()
            raise DeviceError(f"no USB device {vid:04x}:{pid:04x} (is the enclosure plugged in and "
                              f"this user allowed to open it?)")
        try:
            self._claim(alt, stream_eps, streams)
        except DeviceError:
            self.close()
            raise
        self._done = ffi.callback("void(struct libusb_transfer *)", lambda t: None)
        self.transfers = 0  # USB transfers completed, for docs/perf.md's load measurement
        self.bytes = 0  # payload bytes moved by them

    def _claim(self, alt: int, stream_eps: tuple[int, ...], streams: int) -> None:
        lib = self.lib
        if lib.libusb_kernel_driver_active(self.handle, 0) == 1:  # uas / usb-storage on Linux
            check(lib.libusb_detach_kernel_driver(self.handle, 0), "libusb_detach_kernel_driver")
        check(lib.libusb_claim_interface(self.handle, 0), "libusb_claim_interface(0)")
        check(lib.libusb_set_interface_alt_setting(self.handle, 0, alt),
              f"libusb_set_interface_alt_setting(0, {alt})")
        eps = ffi.new("unsigned char[]", stream_eps)
        check(lib.libusb_alloc_streams(self.handle, streams, eps, len(stream_eps)),
              f"libusb_alloc_streams({streams})")

    def run(self, batch: list[tuple[int, int, object, int]], timeout_s: float) -> None:
        """Submit (endpoint, stream id or 0, cffi buffer, length) transfers together and return
        when all completed; DeviceError (all cancelled) on an error, a stall, a lost device or
        the deadline."""
        deadline = time.monotonic() + timeout_s
        ms = max(1, int(timeout_s * 1000))
        ts = []
        try:
            for ep, stream, buf, n in batch:
                t = self.lib.libusb_alloc_transfer(0)
                ts.append(t)
                t.dev_handle, t.endpoint, t.buffer, t.length = self.handle, ep, buf, n
                t.type, t.timeout, t.callback, t.status = \
                    (TRANSFER_BULK_STREAM if stream else TRANSFER_BULK), ms, self._done, PENDING
                t.num_iso_packets, t.flags = 0, 0
                if stream:
                    self.lib.libusb_transfer_set_stream_id(t, stream)
                check(self.lib.libusb_submit_transfer(t), f"submit to endpoint 0x{ep:02x}")
            self._pump(ts, deadline)
        finally:
            self._cancel(ts)
        self.transfers += len(ts)
        self.bytes += sum(t.actual_length for t in ts)

    def _pump(self, ts, deadline: float) -> None:
        tv = ffi.new("struct timeval *")
        while any(t.status == PENDING for t in ts):
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeviceError(f"USB transfers not done by their deadline "
                                  f"({sum(t.status == PENDING for t in ts)} of {len(ts)} pending)")
            tv.tv_sec, tv.tv_usec = 0, int(min(left, 0.01) * 1e6)
            check(self.lib.libusb_handle_events_timeout_completed(self.ctx, tv, ffi.NULL),
                  "libusb_handle_events")
        bad = next((t for t in ts if t.status != COMPLETED), None)
        if bad is not None:
            raise DeviceError(f"USB transfer on endpoint 0x{bad.endpoint:02x}: "
                              f"{STATUS[bad.status] if 0 <= bad.status < 7 else bad.status}")

    def _cancel(self, ts) -> None:
        """Cancel what is still pending, give libusb a bounded moment to hand the transfers back,
        and free them (a transfer libusb still owns is leaked, never freed under it)."""
        for t in ts:
            if t.status == PENDING:
                self.lib.libusb_cancel_transfer(t)
        tv = ffi.new("struct timeval *")
        tv.tv_usec = 1000
        end = time.monotonic() + 0.1
        while any(t.status == PENDING for t in ts) and time.monotonic() < end:
            self.lib.libusb_handle_events_timeout_completed(self.ctx, tv, ffi.NULL)
        for t in ts:
            if t.status != PENDING:
                self.lib.libusb_free_transfer(t)

    def close(self) -> None:
        if self.handle != ffi.NULL:
            self.lib.libusb_release_interface(self.handle, 0)
            self.lib.libusb_close(self.handle)
            self.handle = ffi.NULL
        if self.ctx != ffi.NULL:
            self.lib.libusb_exit(self.ctx)
            self.ctx = ffi.NULL
