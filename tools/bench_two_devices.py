"""Host time per frame of the split modeld step on two devices, the warp on qcom (mock KGSL) and
the queues and models on amd (the mock USB GPU): docs/modeld.md "Two devices".

    python tools/bench_two_devices.py [--frames N] [--mode pipeline|chain]

--mode pipeline: runner/pipeline.py, one Pipeline.run per frame (the planes stay in the warp's
KGSL memory; the amd side uploads them from there). --mode chain: what tests/modeld_replay.py
did before it, the warp's planes read back into numpy arrays, then fed to the model's run.
The split models (models/openpilot_split.py, the 1344x760 camera) are compiled first (`qcom
--float16` and `amd`, a few seconds, into a temporary folder).

Per frame it reports the wall time and the time spent inside the two simulators: the mock
KGSL's ioctls (the Adreno's kernels, which it runs inside GPU_COMMAND, included) and the mock
libusb's event handling (the USB link, the bridge and the USB GPU's work, which it does as it
plays the submitted transfers; submitting a transfer is bookkeeping, counted as host). Wall
minus simulators is host time: the runtime and the drivers' host halves (qcom/, am/, usbgpu/),
the link excluded; the same in CPU time (time.process_time, which a loaded machine disturbs
less). And what crossed the link: bulk OUT bytes and USB transfers.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import pathlib  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from compiler.blob import write_blob  # noqa: E402
from compiler.pipeline import compile_model  # noqa: E402
from models import modeld_ref as ref  # noqa: E402
from models.modeld_step import entry_name, split_entries  # noqa: E402
from models.openpilot_split import make_policy, make_vision  # noqa: E402
from runner import Model  # noqa: E402
from tools.cli import Parser, positive_int  # noqa: E402

CAM, CAMS, MODEL_SIZE, FS = (1344, 760), [(1928, 1208), (1344, 760)], (512, 256), 4
WARP_IN = ("frame", "tfm", "big_frame", "big_tfm")


def load(folder: str) -> tuple[Model, Model]:
    """The warp blob on qcom and the model blob on amd, both on their simulators."""
    from am import firmware
    from sim.am import standin
    from sim.am.mock_device import IPS
    os.environ.update(KEEL_KGSL="mock", KEEL_USB="mock")
    os.environ[firmware.ENV] = folder
    standin.write_all(pathlib.Path(folder), {(ip.hw_id, ip.instance): ip for ip in IPS})
    warps, steps = split_entries(make_vision(), make_policy(), MODEL_SIZE, CAMS, FS)
    paths = []
    for name, graphs, target, half in (("warp", warps, "qcom", True),
                                       ("model", steps, "amd", False)):
        paths.append(os.path.join(folder, f"{name}.blob"))
        write_blob(compile_model(graphs, target=target, float16=half), paths[-1])
    return Model.load(paths[0], device="qcom"), Model.load(paths[1], device="amd")


class SimClock:
    """Wall and CPU seconds spent inside the simulators' entry points, and the bytes and
    transfers submitted to the mock link, since the last reset()."""

    def __init__(self, warp: Model):
        from sim.usb.mock import MockLibusb
        from usbgpu.asm24 import EP_DATA_OUT
        self.reset()
        driver = warp.device.kgsl.driver
        driver.ioctl = self.timed(driver.ioctl)
        usb = MockLibusb.shared()
        events = "libusb_handle_events_timeout_completed"
        setattr(usb, events, self.timed(getattr(usb, events)))
        submit = usb.libusb_submit_transfer

        def counted(t):
            self.transfers += 1
            self.bytes_out += t.length if t.endpoint == EP_DATA_OUT else 0
            return submit(t)
        usb.libusb_submit_transfer = counted

    def reset(self) -> None:
        self.seconds = self.cpu = 0.0
        self.transfers = self.bytes_out = 0

    def timed(self, fn):
        def call(*args):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - t0
                self.cpu += time.process_time() - c0
        return call


def chain(warp: Model, model: Model):
    """The host chain: the warp's planes come back as numpy arrays, the model is fed them."""
    def run(feeds: dict, kind: str) -> dict:
        planes = warp.run({k: feeds[k] for k in WARP_IN}, entry=entry_name(CAM, "warp"))
        rest = {k: v for k, v in feeds.items() if k not in WARP_IN}
        return model.run({**planes, **rest}, entry=kind)
    return run


def pipeline(warp: Model, model: Model):
    from runner.pipeline import Pipeline
    pipe = Pipeline([warp, model])

    def run(feeds: dict, kind: str) -> dict:
        return pipe.run(feeds, (entry_name(CAM, "warp"), kind))
    return run


def frames(n: int):
    """n frames of random pixels, transforms and desires, every fourth one warp-only."""
    rng, nv12 = np.random.default_rng(0), ref.nv12_layout(*CAM)
    for i in range(n):
        feeds = {"frame": rng.integers(0, 256, nv12.size, dtype=np.uint8),
                 "big_frame": rng.integers(0, 256, nv12.size, dtype=np.uint8),
                 "tfm": ref.random_tfm(rng, CAM, MODEL_SIZE),
                 "big_tfm": ref.random_tfm(rng, CAM, MODEL_SIZE)}
        if i % 4 == 3:
            yield feeds, "warp_enqueue"
            continue
        feeds["desire"] = (rng.random(8) > 0.8).astype(np.float32)
        feeds["traffic_convention"] = np.eye(2, dtype=np.float32)[rng.integers(2)]
        yield feeds, "run_policy"


def main() -> None:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=positive_int, default=40)
    p.add_argument("--mode", choices=("pipeline", "chain"), default="pipeline")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="keel-two-") as folder:
        warp, model = load(folder)
        clock, run = SimClock(warp), {"chain": chain, "pipeline": pipeline}[args.mode](warp, model)
        rows = []  # per frame: wall, simulators' wall, host CPU, bytes out, transfers
        for i, (feeds, kind) in enumerate(frames(args.frames + 1)):
            clock.reset()
            t0, c0 = time.perf_counter(), time.process_time()
            run(feeds, kind)
            if i:  # the first frame binds and patches everything once
                rows.append((time.perf_counter() - t0, clock.seconds,
                             time.process_time() - c0 - clock.cpu, clock.bytes_out,
                             clock.transfers))
        model.close()
        warp.close()
    wall, sim, cpu, out, transfers = np.array(rows).T
    ms = lambda a: f"{np.median(a) * 1e3:.2f} ({a.min() * 1e3:.2f})"  # noqa: E731
    print(f"{args.mode}: {args.frames} frames, median (min) ms: wall {ms(wall)}, in the "
          f"simulators {ms(sim)}, host {ms(wall - sim)}, host CPU {ms(cpu)}; per frame over USB: "
          f"{np.mean(out) / 1e3:.1f} KB out in {np.mean(transfers):.0f} transfers")


if __name__ == "__main__":
    main()
