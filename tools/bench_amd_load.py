"""What loading a blob on device="amd" moves over USB: bytes, USB transfers and bridge commands
against the weights' size, through the mock enclosure (KEEL_USB=mock) or a real one.

    python tools/bench_amd_load.py model.blob [--real] [--runs N] [--fw-part-kib K]

With the mock (the default) the counts are exactly what the host sends and receives; the times
are the mock's (Python answering every transfer), not a USB link's: a real enclosure's time is
printed by tests/device/test_usbgpu.py. Stand-in firmware files are made for the mock (keel ships
none), each of their 26 parts K KiB (--fw-part-kib; real parts are tens to hundreds of KiB);
--real uses KEEL_AMD_FIRMWARE or /lib/firmware/amdgpu. The bring-up alone (the firmware set
through the PSP, the hubs, the queue) is measured first on its own enclosure. Last, the process's
peak RSS (VmHWM): the blob's private copy, and with the mock its VRAM (the pages written).
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def _stand_in_firmware(part_bytes: int) -> str:
    from sim.am import standin
    from sim.am.mock_device import IPS
    folder = Path(tempfile.mkdtemp(prefix="keel-fw-"))
    standin.write_all(folder, {(ip.hw_id, ip.instance): ip for ip in IPS}, part_bytes)
    return str(folder)


def bring_up() -> None:
    """The firmware set and the rest of the bring-up, without a model."""
    from am.driver import Gpu
    from am.firmware import ENV, DEFAULT_DIR
    from usbgpu.pci import UsbPci
    if os.environ.get("KEEL_USB") == "mock":
        from sim.usb.mock import MockLibusb
        MockLibusb.forget()
    folder = Path(os.environ.get(ENV, DEFAULT_DIR))
    fw = sum(p.stat().st_size for p in folder.glob("*.bin"))
    t = time.perf_counter()
    gpu = Gpu(UsbPci(1.0))
    usb, bridge = gpu.pci.usb, gpu.pci.bridge
    print(f"bring-up: firmware files {fw} B; {usb.bytes} B over USB, {usb.transfers} USB "
          f"transfers, {bridge.commands_sent} bridge commands, {time.perf_counter() - t:.1f} s")
    gpu.close()
    if os.environ.get("KEEL_USB") == "mock":
        from sim.usb.mock import MockLibusb
        MockLibusb.forget()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("blob")
    ap.add_argument("--real", action="store_true", help="a real enclosure, not the mock")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fw-part-kib", type=int, default=0, help="stand-in part size (0: 64 B)")
    args = ap.parse_args()
    if not args.real:
        os.environ["KEEL_USB"] = "mock"
        os.environ.setdefault("KEEL_AMD_FIRMWARE",
                              _stand_in_firmware(args.fw_part_kib << 10 or 64))
    bring_up()
    from runner import Model
    t = time.perf_counter()
    m = Model.load(args.blob, device="amd")
    load_s = time.perf_counter() - t
    blob = m.blob  # the copy the device loaded from (a second read_blob would double RSS)
    usb, bridge = m.device.gpu.pci.usb, m.device.gpu.pci.bridge
    weights = len(blob.weights)
    print(f"weights {weights} B, code object {len(blob.programs)} B, "
          f"{len(blob.launches)} launches")
    print(f"load: {usb.bytes} B over USB ({usb.bytes / max(weights, 1):.3f} x the weights), "
          f"{usb.transfers} USB transfers ({usb.transfers / max(weights / 4096, 1):.1f} per 4 KiB "
          f"of weights), {bridge.commands_sent} bridge commands, {load_s:.1f} s")
    feeds = {b.name: m.input_view(b.name) for b in blob.inputs}
    before = (usb.bytes, usb.transfers)
    t = time.perf_counter()
    for _ in range(args.runs):
        m.run(feeds, timeout_ms=600_000)
    per = (time.perf_counter() - t) / args.runs
    print(f"run: {(usb.bytes - before[0]) // args.runs} B, "
          f"{(usb.transfers - before[1]) // args.runs} USB transfers per run, {per * 1e3:.0f} ms")
    peak = next(int(line.split()[1]) for line in open("/proc/self/status")
                if line.startswith("VmHWM"))
    print(f"peak RSS {peak} KiB ({peak * 1024 / max(weights, 1):.2f} x the weights; with the "
          f"mock, its VRAM is one of them)")


if __name__ == "__main__":
    main()
