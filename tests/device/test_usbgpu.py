"""An AMD GPU in an ASM2464PD USB enclosure: the bridge protocol, PCI enumeration and the am/
bring-up on the hardware, then a model's load time and latency beside the CPU backend.

    KEEL_AMD_FIRMWARE=/lib/firmware/amdgpu python -m pytest -q -s tests/device/test_usbgpu.py

Skipped unless a bridge with a known id (usbgpu/asm24.py IDS) opens. The same calls run against
the mock enclosure in tests/test_usbgpu.py and tests/test_amd_device.py; here the bridge firmware
and the GPU answer instead. What only this file can show: that the stock or custom bridge firmware
accepts the vendor commands, that the register offsets am/regs.py marks UNVERIFIED are right,
that the gfx1100 code the compiler emits computes what PoCL computed, and how long it all takes.
Expected to fail before am/ loads the rest of the microcode (docs/amd.md).
"""
import os
import time

import numpy as np

from runner.errors import DeviceError
from tests.deps import needs_hardware


def _enclosure_missing() -> str | None:
    if os.environ.get("KEEL_USB"):
        return "KEEL_USB is set (the mock): unset it to use the hardware"
    try:
        from usbgpu.pci import UsbPci
        UsbPci().close()
    except DeviceError as e:
        return str(e)
    return None


pytestmark = needs_hardware("ASM24xx enclosure with an AMD GPU", _enclosure_missing())


def test_the_gpu_behind_the_bridge_is_an_rx_7900():
    from usbgpu.pci import UsbPci
    t = time.monotonic()
    pci = UsbPci()
    ids = pci.cfg_read(0)
    print(f"link up in {time.monotonic() - t:.2f} s, {pci.usb.transfers} USB transfers; "
          f"GPU {ids & 0xFFFF:04x}:{ids >> 16:04x} on bus {pci.bus}, BARs "
          f"{ {i: (hex(a), s >> 20) for i, (a, s) in pci.bars.items()} } (MiB)")
    assert ids & 0xFFFF == 0x1002
    pci.close()


def test_ip_discovery_reads_gfx11():
    from am import discovery
    from am.driver import discover, vram_size
    from usbgpu.pci import UsbPci
    pci = UsbPci()
    try:
        vram = vram_size(pci)  # RCC_CONFIG_MEMSIZE
        # BAR0 at 32 GiB if its Resizable BAR grew it (discovery then reads through it with
        # 4-dword requests), else 256 MiB below 4 GiB (discovery through MM_INDEX/MM_DATA)
        print(f"VRAM {vram >> 20} MiB, BAR0 {pci.bars[0][1] >> 20} MiB at 0x{pci.bars[0][0]:x}")
        assert vram >= 8 << 30
        ips = discover(pci, vram)  # no firmware is sent
        print({ip.name: ip.version for ip in ips.values() if ip.instance == 0})
        assert ips[11, 0].version[0] == 11
        assert discovery.HW_IDS[11] == "GC"
    finally:
        pci.close()


def test_a_model_loads_and_runs_beside_the_cpu(doctor_amd):
    from runner import Model
    from tests.graphs import assert_close, compiled_blob, random_feeds, single_node_model
    w = np.random.default_rng(0).standard_normal((64, 32, 3, 3)).astype(np.float32)
    model = single_node_model("Conv", [((1, 32, 64, 64), "float32"), w], {"pads": [1, 1, 1, 1]})
    feeds = random_feeds(model)
    times = {}
    for target, device in (("cpu", "cpu"), ("amd", "amd")):
        t = time.monotonic()
        m = Model.load(compiled_blob(model, target=target), device=device)
        load = time.monotonic() - t
        m.run(feeds)
        t = time.monotonic()
        out = m.run(feeds)["y"]
        times[device] = (load, time.monotonic() - t, out)
        print(f"{device}: load {load * 1e3:.0f} ms, run {times[device][1] * 1e3:.1f} ms")
    # fp32 on two devices, different summation orders over 288 products: 1e-4
    assert_close(times["amd"][2], times["cpu"][2], 1e-4, 1e-4, "amd vs cpu")
