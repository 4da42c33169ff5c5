"""usbgpu/: the libusb binding checked against libusb.h, and the ASM24xx protocol, PCI enumeration,
BAR access, the DMA window and failure handling, run against the mock bridge at the libusb
boundary (sim/usb/mock.py).

What this cannot prove: how the real bridge firmware answers (timing, its error paths, whether
the stock firmware accepts the vendor CDBs). tests/device/test_usbgpu.py runs on an enclosure.
"""
from __future__ import annotations

import subprocess
import time

import pytest

from runner.errors import ConfigError, DeviceError
from tests.deps import needs, needs_tool
from usbgpu import asm24, libusb
from sim.usb.mock import Config, Function, MockBridge, MockLibusb, Port
from usbgpu.pci import UsbPci, open_lib

HEADER = "/usr/include/libusb-1.0/libusb.h"
TIMEOUT_S = 0.5


def enclosure():
    """An ASM2464 port, a Navi 31's upstream and downstream switch ports, and a display function
    with the 7900 XTX's ids and BAR kinds (BAR0 VRAM and BAR2 doorbells 64-bit prefetchable,
    BAR5 registers 32-bit; sizes shrunk to keep the test light)."""
    gpu = Function(0x1002, 0x744C, 0x03, {0: (16 << 20, 0xC), 2: (2 << 20, 0xC), 5: (1 << 20, 0)})
    ports = [Port(0x1B21, 0x2461), Port(0x1002, 0x1478), Port(0x1002, 0x1479)]
    return MockLibusb(MockBridge(ports, gpu)), gpu


@pytest.fixture
def dev():
    lib, gpu = enclosure()
    pci = UsbPci(TIMEOUT_S, lib=lib)
    yield pci, lib, gpu
    pci.close()


def test_link_up_assigns_buses_and_bars_and_enables_the_function(dev):
    pci, lib, gpu = dev
    assert (pci.bus, pci.path) == (3, [0, 1, 2])
    assert pci.cfg_read(0) == 0x744C1002
    assert {i: size for i, (_, size) in pci.bars.items()} == {0: 16 << 20, 2: 2 << 20, 5: 1 << 20}
    bases = sorted(a for a, _ in pci.bars.values())
    assert bases[0] >= 0x1000_0000 and all(a % s == 0 for a, s in pci.bars.values())
    assert gpu.config.command & 6 == 6  # memory decoding and bus mastering on
    assert all(p.config.data[0x19] == b + 1 for b, p in zip(pci.path, lib.bridge.ports))


def test_the_firmware_version_is_read_from_xdata_with_the_vendor_read(dev):
    pci, lib, _ = dev
    lib.bridge.xdata[asm24.FW_VERSION:asm24.FW_VERSION + 6] = bytes.fromhex("2303210a0b0c")
    lib.bridge.xdata[asm24.FW_VERSION + 6] = 0xFF  # a byte past the field is not read
    assert pci.bridge.firmware_version() == "230321_0A_0B_0C"
    # the CDB as cyrozap's asm2x6x_tool sends it to an ASM246x: E4, 6 bytes, 0x50:07F0
    assert asm24.xdata_cdb(asm24.XDATA_READ, 6, asm24.FW_VERSION) == bytes.fromhex("e406 5007f0 00")


def test_bar_reads_and_writes_reach_the_function_memory(dev):
    pci, _, gpu = dev
    pci.write32(5, 0x1230, 0xCAFEF00D)
    assert gpu.mem_read(5, 0x1230) == 0xCAFEF00D and pci.read32(5, 0x1230) == 0xCAFEF00D
    base = pci.bars[0][0]
    pci.bridge.mem(base + 6, 0xBEEF, size=2)  # byte enables: only bytes 6 and 7 change
    assert gpu.memory[0][4:8] == b"\0\0\xef\xbe" and pci.bridge.mem(base + 6, size=2) == 0xBEEF
    with pytest.raises(DeviceError, match="outside its"):
        pci.read32(5, 1 << 20)


def test_an_address_no_bar_claims_is_an_unsupported_request(dev):
    pci, _, _ = dev
    with pytest.raises(DeviceError, match="unsupported request"):
        pci.bridge.mem(0x0800_0000)  # below every bridge's window
    with pytest.raises(DeviceError, match="unsupported request"):
        pci.bridge.config(7, 0, 0, 0)  # no bus 7 below the bridges


def test_dma_window_is_what_the_device_reads_at_its_bus_address(dev):
    pci, lib, _ = dev
    data = bytes(range(256)) * 16
    pci.dma_put(data)
    assert lib.bridge.host_read(pci.window[0], len(data)) == data
    lib.bridge.host_write(pci.window[0] + 100, b"signal")
    assert pci.dma_get(100, 6) == b"signal"
    with pytest.raises(ValueError, match="outside the bridge's SRAM"):
        lib.bridge.host_read(pci.staging[0] + pci.staging[1] - 100, 200)


def test_staging_fills_the_sram_in_64k_writes_and_the_window_still_lands_at_its_start(dev):
    """A 200 KiB firmware image goes as four WRITE(16)s of 64 KiB (each with the window's re-arm
    writes) between fill resets: the device reads it whole from the bus address; the next window
    write lands at the start again; a buffer beyond the SRAM is refused."""
    pci, lib, _ = dev
    image = bytes(range(251)) * (200 * 1024 // 251)
    before = pci.bridge.commands_sent
    pci.stage(image)
    assert pci.bridge.commands_sent - before == 4 * (1 + 5) + 2 * 4  # chunks + re-arm, 2 resets
    assert lib.bridge.host_read(pci.staging[0], len(image)) == image
    pci.dma_put(b"ring")
    assert lib.bridge.host_read(pci.window[0], 4) == b"ring"
    assert lib.bridge.host_read(pci.staging[0] + 4096, 100) == image[4096:4196]
    pci.stage(image[::-1])  # the fill was reset: the next image starts at the start too
    assert lib.bridge.host_read(pci.staging[0], len(image)) == image[::-1]
    with pytest.raises(ValueError, match="the region is 524288"):
        pci.stage(bytes(pci.staging[1] + 1))


def test_the_bridge_refuses_an_unknown_command(dev):
    pci, _, _ = dev
    with pytest.raises(DeviceError, match="bridge refused CDB e9"):
        pci.bridge.commands([(b"\xe9\x00\x00\x00\x00\x00", 0, None)])
    with pytest.raises(DeviceError, match="refused"):  # XDATA address without the 0x50 tag
        pci.bridge.commands([(b"\xe5\x01\x00\x01\x00\x00", 0, None)])


def test_unplug_mid_transfer_is_a_device_error_and_replug_brings_the_link_back(dev):
    pci, lib, gpu = dev
    lib.unplug()
    t = time.monotonic()
    with pytest.raises(DeviceError, match="no device|NO_DEVICE"):
        pci.read32(5, 0)
    # a lost device is reported at once, not at the transfer's deadline
    assert time.monotonic() - t < TIMEOUT_S
    lib.replug()
    again = UsbPci(TIMEOUT_S, lib=lib)
    again.write32(5, 8, 7)
    assert gpu.mem_read(5, 8) == 7
    again.close()


def test_a_bridge_that_stops_answering_fails_at_the_deadline(dev):
    pci, lib, _ = dev
    lib.hang = True
    t = time.monotonic()
    with pytest.raises(DeviceError, match="deadline"):
        pci.read32(5, 0)
    # the contract: never blocked past the deadline by more than one event slice (10 ms)
    assert TIMEOUT_S <= time.monotonic() - t < TIMEOUT_S + 0.25
    assert lib.pending == [] and lib.owned == {}  # every transfer cancelled and freed


def test_no_bridge_present_names_the_ids_tried():
    lib, _ = enclosure()
    lib.unplug()
    with pytest.raises(DeviceError, match="174c:2464.*2d01:3666"):
        UsbPci(TIMEOUT_S, lib=lib)


def test_keel_usb_rejects_an_unknown_mode(monkeypatch):
    monkeypatch.setenv("KEEL_USB", "fake")
    with pytest.raises(ConfigError, match="KEEL_USB='fake': expected 'mock'"):
        open_lib()


def test_command_iu_is_the_uas_layout():
    iu = asm24.command_iu(0x0102, b"\xe4\x04\x50\xb2\x96\x00")
    assert len(iu) == 32 and iu[:4] == b"\x01\x00\x01\x02"
    assert iu[16:22] == b"\xe4\x04\x50\xb2\x96\x00"
    assert asm24.xdata_cdb(asm24.XDATA_WRITE, 0x33, 0x1B296) == b"\xe5\x33\x51\xb2\x96\x00"


def _libusb_missing() -> str | None:
    try:
        libusb.load()
    except DeviceError as e:
        return str(e)
    return None


@needs("libusb-1.0-0", _libusb_missing())
def test_the_real_library_loads_and_names_errors_as_we_do():
    lib = libusb.load()
    for rc, name in libusb.ERROR_NAMES.items():
        assert libusb.ffi.string(lib.libusb_error_name(rc)).decode() == name


PROBE = r"""
#include <stddef.h>
#include <stdio.h>
#include <libusb.h>
int main(void) {
  printf("%zu", sizeof(struct libusb_transfer));
#define F(f) printf(" %zu", offsetof(struct libusb_transfer, f))
  F(dev_handle); F(flags); F(endpoint); F(type); F(timeout); F(status); F(length);
  F(actual_length); F(callback); F(user_data); F(buffer); F(num_iso_packets); F(iso_packet_desc);
  printf(" %d %d %d %d\n", LIBUSB_TRANSFER_TYPE_BULK, LIBUSB_TRANSFER_TYPE_BULK_STREAM,
         LIBUSB_TRANSFER_NO_DEVICE, LIBUSB_ERROR_NO_DEVICE);
  return 0;
}
"""


@needs_tool("clang-19", "clang-19")
@needs("libusb-1.0-0-dev", None if __import__("os").path.exists(HEADER) else f"no {HEADER}")
def test_struct_libusb_transfer_matches_the_header(tmp_path):
    """libusb.h of Debian's libusb-1.0-0-dev (1.0.26), compiled for this host."""
    (tmp_path / "probe.c").write_text(PROBE)
    subprocess.run(["clang-19", "-I/usr/include/libusb-1.0", "probe.c", "-o", "probe"],
                   cwd=tmp_path, check=True)
    got = [int(v) for v in subprocess.run([str(tmp_path / "probe")], capture_output=True,
                                          text=True, check=True).stdout.split()]
    ffi = libusb.ffi
    fields = ("dev_handle", "flags", "endpoint", "type", "timeout", "status", "length",
              "actual_length", "callback", "user_data", "buffer", "num_iso_packets",
              "iso_packet_desc")
    want = [ffi.sizeof("struct libusb_transfer")] + \
        [ffi.offsetof("struct libusb_transfer", f) for f in fields] + \
        [libusb.TRANSFER_BULK, libusb.TRANSFER_BULK_STREAM, libusb.NO_DEVICE,
         libusb.ERROR_NO_DEVICE]
    assert got == want


def test_a_resizable_bar0_is_grown_and_placed_above_4_gib_behind_64_bit_windows():
    """BAR0 offers 16 to 64 MiB through its Resizable BAR capability: enumeration grows it to
    64 MiB and puts the 64-bit prefetchable BARs at 32 GiB, reached through each bridge's
    prefetchable window (upper halves set) with 4-dword requests; BAR5 stays below 4 GiB."""
    gpu = Function(0x1002, 0x744C, 0x03, {0: (16 << 20, 0xC), 2: (2 << 20, 0xC), 5: (1 << 20, 0)})
    offers = {0: (16 << 20, 32 << 20, 64 << 20)}
    gpu.config = Config(0x1002, 0x744C, 0x03, 0, gpu.config.bars, offers)
    gpu.memory[0] = bytearray(64 << 20)
    ports = [Port(0x1B21, 0x2461), Port(0x1002, 0x1478), Port(0x1002, 0x1479)]
    lib = MockLibusb(MockBridge(ports, gpu))
    pci = UsbPci(TIMEOUT_S, lib=lib)
    assert pci.bars[0] == (32 << 30, 64 << 20) and pci.bars[2][0] == (32 << 30) + (64 << 20)
    assert pci.bars[5][0] < 1 << 32
    assert all(p.routes_mem(pci.bars[2][0]) and not p.routes_mem(1 << 32) for p in ports)
    pci.write32(0, (64 << 20) - 4, 0x12345678)  # BAR0's last dword: a 64-bit request
    assert gpu.memory[0][-4:] == bytes.fromhex("78563412")
    pci.close()
