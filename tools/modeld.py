"""Replay a blob the way openpilot's modeld runs it: a frame every 1/hz s, for hours if asked.

    python tools/modeld.py model.blob [--device D] [--hz 20] [--frames N | --minutes M]
                           [--timeout-ms MS] [--budget-ms MS] [--camera WxH] [--json]

A pipeline blob (tools/compile_modeld.py: the whole step, queues on the device) is fed as
openpilot's modeld feeds its compiled step (PipelineFeeder): synthetic NV12 frames of the camera
(--camera, default the blob's first resolution) written into rings of page-aligned buffers and
bound zero-copy to `frame` and `big_frame`, the transforms and traffic convention written once,
the desire as modeld's rising-edge pulse; the frame right after frames the loop dropped goes
through `WxH/warp_enqueue` (modeld's prepare_only), every other one through `WxH/run_policy`.
Nothing is fed back on the host: the queues live in the blob's state.

Any other blob, per frame (the README's "Feeding a model like modeld" is the same sequence):
the next synthetic camera frames are written into a ring of buffers this tool owns, as the vision
pipeline would, and bound to the uint8 inputs without a copy; desire and feature histories
shift in place, the newest feature being the previous frame's `hidden_state` output (when the
model has openpilot's output_slices); the model runs into preallocated outputs, cut into named
views.

modeld has no try/except around its model call, so an exception there ends it. Here a
DeviceTimeout or DeviceError is a dropped frame, a log line on stderr and a recovery (the next
run() recovers the device), never an exit. A frame the camera delivered while a run was still
busy is dropped too (skipped), as modeld's frame-id gap counts it. The default run deadline is
one frame period: a run still busy when the next frame arrives has lost its frame already.

Reports frame time (from the frame's start to its outputs sliced and fed back) p50/p99/max,
frames over the budget (default one period), and dropped frames; openpilot flags modeldLagging
past 1% dropped.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import json  # noqa: E402
import mmap  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from models.modeld_ref import random_tfm  # noqa: E402
from models.modeld_step import entry_name, parse_size  # noqa: E402

from runner import BlobError, ConfigError, DeviceError, DeviceTimeout, Model  # noqa: E402
from tools.cli import Parser, number, positive_int, timeout_ms  # noqa: E402
from tools.run import random_feeds  # noqa: E402

RING = 3  # camera buffers the "vision pipeline" rotates through
BANK = 4  # distinct synthetic frames per camera
LAGGING = 0.01  # openpilot's modeldLagging: more than 1% of frames dropped


class Feeder:
    """Synthetic modeld inputs: camera rings bound zero-copy, histories shifted in place."""

    def __init__(self, m: Model, seed: int = 0):
        self.m = m
        self.out = {n: np.empty(s, d) for n, (s, d) in m.outputs.items()}
        self.views = m.output_views(self.out) if m.output_slices else {}
        feeds = random_feeds(m.inputs, seed)
        rng = np.random.default_rng(seed + 1)
        self.cams = {}  # name -> (bank of frames, ring of buffers the model is bound to)
        for name, (shape, dtype) in m.inputs.items():
            if dtype == np.uint8:
                bank = rng.integers(0, 256, (BANK, *shape), dtype=np.uint8)
                self.cams[name] = (bank, [np.empty(shape, np.uint8) for _ in range(RING)])
            else:
                m.input_view(name)[:] = feeds[name]
        self.features = self._history("features_buffer", "hidden_state")
        self.desire = m.input_view("desire_pulse") if "desire_pulse" in m.inputs else None

    def _history(self, name: str, source: str):
        if name not in self.m.inputs or source not in self.views:
            return None
        hist = self.m.input_view(name)
        return hist if hist.shape[-1] == self.views[source].size else None

    def entry(self, prepare_only: bool) -> None:
        return None  # one model: a frame after a drop runs it as any other

    def before(self, i: int, entry: str | None = None) -> None:
        for name, (bank, ring) in self.cams.items():
            buf = ring[i % RING]
            np.copyto(buf, bank[i % BANK])  # the vision pipeline writes its own buffer...
            self.m.bind_input(name, buf)  # ...and the model reads it where it is
        if self.desire is not None:
            self.desire[0, :-1] = self.desire[0, 1:]
            self.desire[0, -1] = 0
            self.desire[0, -1, i % self.desire.shape[-1]] = 1

    def outs(self, entry: str | None = None) -> dict:
        return self.out

    def after(self, entry: str | None = None) -> None:
        if self.features is not None:
            self.features[0, :-1] = self.features[0, 1:]
            self.features[0, -1] = self.views["hidden_state"]


class PipelineFeeder:
    """modeld's inputs to a pipeline blob's entries (the module docstring)."""

    def __init__(self, m: Model, camera: str | None = None, seed: int = 0):
        desc = json.loads(m.meta["metadata"]["modeld"])
        camera = camera or next(iter(desc["cameras"]))
        if camera not in desc["cameras"]:
            raise ValueError(f"camera {camera}: expected one of {list(desc['cameras'])}")
        cam = parse_size(camera)
        self.m = m
        self.warp, self.policy = entry_name(cam, "warp_enqueue"), entry_name(cam, "run_policy")
        size = desc["cameras"][camera]["size"]
        rng = np.random.default_rng(seed)
        self.bank = rng.integers(0, 256, (2, BANK, size), dtype=np.uint8)
        self.rings = [[page_aligned(size) for _ in range(RING)] for _ in range(2)]
        tfms = {t: random_tfm(rng, cam, desc["model_size"]) for t in ("tfm", "big_tfm")}
        for e in (self.warp, self.policy):  # one calibration, seen by both entries
            for name, tfm in tfms.items():
                m.input_view(name, e)[:] = tfm
        m.input_view("traffic_convention", self.policy)[:] = [1, 0]
        self.desire, self.prev_desire = m.input_view("desire", self.policy), np.zeros(8)
        self.out = {self.warp: {}, self.policy: {n: np.empty(s, d) for n, (s, d)
                                                 in m.entries[self.policy].outputs.items()}}
        self.views = {}  # {"vision": {head: view}, "policy": {...}}: the heads of this frame
        for part, name in (("vision", "vision_out"), ("policy", "policy_out")):
            flat = self.out[self.policy][name].reshape(-1)
            self.views[part] = {k: flat[a:b] for k, (a, b) in desc[part]["output_slices"].items()}

    def entry(self, prepare_only: bool) -> str:
        return self.warp if prepare_only else self.policy

    def before(self, i: int, entry: str) -> None:
        for k, name in enumerate(("frame", "big_frame")):
            buf = self.rings[k][i % RING]
            np.copyto(buf, self.bank[k, i % BANK])  # the vision pipeline writes its buffer...
            self.m.bind_input(name, buf, entry)  # ...and the step reads it where it is
        if entry == self.policy:  # modeld's desire: a pulse on the rising edge
            new = np.eye(8)[(i // 20) % 8]
            self.desire[:] = np.where(new - self.prev_desire > .99, new, 0)
            self.prev_desire = new

    def outs(self, entry: str) -> dict:
        return self.out[entry]

    def after(self, entry: str) -> None:
        pass  # the queues moved on the device; the outputs are in self.views


def page_aligned(nbytes: int) -> np.ndarray:
    """A buffer on its own pages, as the camera's are: a GPU maps it without a copy."""
    return np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)


def feeder(m: Model, camera: str | None = None):
    if "modeld" in m.meta.get("metadata", {}):
        return PipelineFeeder(m, camera)
    if camera is not None:
        raise ValueError("--camera: this blob is not a pipeline blob (tools/compile_modeld.py)")
    return Feeder(m)


def replay(m: Model, hz: float, frames: int, timeout_ms: float, budget_ms: float,
           log=None, camera: str | None = None, trace: list | None = None) -> dict:
    """Replay `frames` frames at `hz`; drop lines go to `log` (default: stderr). `trace`, when
    given, gets (frame, entry) for every run that completed."""
    log = log or sys.stderr
    feed, period = feeder(m, camera), 1 / hz
    times, timeouts, device_errors, skipped, warp_only = [], 0, 0, 0, 0
    prepare_only = False
    t0 = time.monotonic()
    i = 0
    while i < frames:
        due = t0 + i * period
        now = time.monotonic()
        if now < due:
            time.sleep(due - now)
        elif now - due >= period:  # frames the camera sent while we were busy: gone
            late = min(int((now - due) / period), frames - i)
            skipped += late
            print(f"frame {i}: {late} frame(s) dropped, the loop is {now - due:.3f} s late",
                  file=log)
            i += late
            prepare_only = True
            continue
        start = time.perf_counter()
        entry = feed.entry(prepare_only)
        feed.before(i, entry)
        try:
            m.run(out=feed.outs(entry), timeout_ms=timeout_ms, entry=entry)
        except (DeviceTimeout, DeviceError) as e:
            timeouts += isinstance(e, DeviceTimeout)
            device_errors += isinstance(e, DeviceError)
            print(f"frame {i}: dropped, {type(e).__name__}: {e}; the next run recovers",
                  file=log)
            i += 1
            continue
        feed.after(entry)
        times.append(time.perf_counter() - start)
        warp_only += entry is not None and entry.endswith("/warp_enqueue")
        if trace is not None:
            trace.append((i, entry))
        prepare_only = False
        i += 1
    return summary(np.array(times) * 1e3, frames, timeouts, device_errors, skipped, warp_only,
                   budget_ms)


def summary(ms: np.ndarray, frames: int, timeouts: int, device_errors: int, skipped: int,
            warp_only: int, budget_ms: float) -> dict:
    dropped = timeouts + device_errors + skipped
    pct = (lambda q: float(np.percentile(ms, q))) if ms.size else (lambda q: None)
    return {"frames": frames, "processed": int(ms.size), "dropped": dropped,
            "timeouts": timeouts, "device_errors": device_errors, "skipped": skipped,
            "warp_only": warp_only,
            "p50_ms": pct(50), "p99_ms": pct(99), "max_ms": pct(100),
            "budget_ms": budget_ms, "over_budget": int((ms > budget_ms).sum()),
            "lagging": dropped > LAGGING * frames}


def report(s: dict) -> str:
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    return (f"frames {s['frames']}: processed {s['processed']}, dropped {s['dropped']} "
            f"(timeouts {s['timeouts']}, device errors {s['device_errors']}, skipped "
            f"{s['skipped']}); after a drop, warp only: {s['warp_only']}\n"
            f"frame time p50 {fmt(s['p50_ms'])} ms, p99 {fmt(s['p99_ms'])} ms, "
            f"max {fmt(s['max_ms'])} ms; over the {s['budget_ms']:.1f} ms budget: "
            f"{s['over_budget']}\nmodeldLagging (>1% dropped): {'yes' if s['lagging'] else 'no'}")


MIN_HZ, MAX_HZ = 0.01, 1000.0  # its period must be a valid run deadline
MAX_MINUTES = 10**6


def main() -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("blob")
    ap.add_argument("--device", help="cpu, opencl, mock, ... (default: the blob's target's)")
    ap.add_argument("--hz", type=number(float, MIN_HZ, MAX_HZ), default=20.0)
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--frames", type=positive_int, help="default 200")
    length.add_argument("--minutes", type=number(float, 0, MAX_MINUTES, low_open=True))
    ap.add_argument("--timeout-ms", type=timeout_ms, help="run deadline (default 1000/hz)")
    ap.add_argument("--budget-ms", type=timeout_ms, help="frame budget (default 1000/hz)")
    ap.add_argument("--camera", help="pipeline blobs: the camera resolution WxH to feed")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = ap.parse_args()
    frames = args.frames or (max(1, round(args.minutes * 60 * args.hz)) if args.minutes else 200)
    period_ms = 1000 / args.hz
    try:
        m = Model.load(args.blob, device=args.device)
    except (BlobError, ConfigError, DeviceError, ValueError) as e:  # ValueError: bad --device
        print(f"modeld: {args.blob}: {e}", file=sys.stderr)
        return 2
    try:
        s = replay(m, args.hz, frames, args.timeout_ms or period_ms, args.budget_ms or period_ms,
                   camera=args.camera)
    except ValueError as e:  # --camera
        print(f"modeld: {e}", file=sys.stderr)
        return 2
    print(json.dumps(s) if args.json else report(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
