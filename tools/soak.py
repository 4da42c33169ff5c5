"""Soak a blob for hours: does the runtime hold, run after run, the way modeld needs it to?

    python tools/soak.py model.blob [--device D] [--hours H | --runs N] [--serial PORT]
                         [--canary-every K] [--log soak.jsonl] [--plot soak.png] [--json]

Runs back to back, fed like modeld (tools/modeld.py's Feeder: camera frames bound zero-copy,
histories shifted in place, hidden_state fed back). What it checks:
- Canary: every K runs, and right after any fault, fixed inputs whose outputs must equal the
  first run's bit for bit. A mismatch fails, with its run number.
- Resources: RSS, open fds, threads and (if the backend reports it through a `memory_bytes()`
  method; none does yet, and on cpu/mock device memory is host memory, inside RSS) device memory,
  sampled every --sample-s. The growth is a robust linear fit (Theil-Sen: the median of pairwise
  slopes) over the samples after warm-up, times their span: a trend, not one noisy sample. It
  fails past --rss-bound-mb (default 4 MiB), or half an fd or thread.
- Latency drift: p50 and p99 in --windows equal parts of the run after warm-up. It fails when the
  last window's p99 exceeds the first's by more than 5% plus 3 sigma, where sigma is the p99's
  window-to-window noise measured on this run: from second differences of the windows' p99s,
  which a steady drift leaves untouched (MAD-scaled; a second difference's variance is 6 sigma^2).
- Faults: DeviceTimeout and DeviceError are counted, logged with their run, recovered from (the
  next run() recovers) and the run goes on. More than --allow-faults of them fails.
- --serial PORT: the device's console (pyserial), each line logged with the run clock; lines
  that look like a GPU fault or a kernel oops are counted as alerts and reported.

Memory it keeps is fixed at the start (latency histograms per window, a sample buffer that halves
its resolution when full), so the harness's own bookkeeping does not look like a leak.

Output: a JSONL log (start, samples, canaries, faults, serial lines, the summary with its
latency windows), a PNG of latency and RSS over time, a summary ending in a one-line verdict;
exit status 0 for OK, 1 for FAIL, 2 for bad arguments or an unusable blob. --json prints the summary as one JSON object.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import errno  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from runner import BlobError, ConfigError, DeviceError, DeviceTimeout, Model  # noqa: E402
from runner.files import check_output  # noqa: E402
from tools.cli import Parser, non_negative_int, number, positive_int, timeout_ms  # noqa: E402
from tools.modeld import Feeder  # noqa: E402
from tools.plot import plot_png  # noqa: E402
from tools.run import random_feeds  # noqa: E402

DRIFT = 0.05  # the bound: last window's p99 at most 5% over the first's, beyond noise
NOISE_SIGMAS = 3.0
MAD = 1.4826  # median absolute deviation -> standard deviation, for normal noise
BINS = np.geomspace(1e-3, 1e5, 1852)  # ms; ratio 1.01 between edges: p99 read to within 1%
SAMPLES = 4096  # sample buffer capacity; full, it keeps every other sample and samples half as often
MAX_EVENTS = 100  # mismatching canaries logged in detail; past that they are only counted
ALERT = re.compile(r"kgsl|adreno|gpu.{0,20}(fault|hang|reset)|page fault|oops|panic|"
                   r"bug:|watchdog", re.I)


def resources(device) -> tuple[float, float, float, float]:
    """(RSS bytes, open fds, threads, device memory bytes or NaN) of this process, now."""
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/status") as f:
            threads = next(int(l.split()[1]) for l in f if l.startswith("Threads:"))
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: peak RSS and Python's own threads are what is portable
        import resource
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform ==
                                                                    "darwin" else 1024)
        threads, fds = threading.active_count(), len(os.listdir("/dev/fd"))
    mem = getattr(device, "memory_bytes", None)
    return float(rss), float(fds), float(threads), float(mem()) if mem else float("nan")


def growth(t: np.ndarray, y: np.ndarray) -> float:
    """Theil-Sen fitted growth of y over the span of t (at most 256 points are used)."""
    ok = np.isfinite(y)
    t, y = t[ok], y[ok]
    if len(t) < 3:
        return 0.0
    pick = np.unique(np.linspace(0, len(t) - 1, min(len(t), 256)).astype(int))
    t, y = t[pick], y[pick]
    i, j = np.triu_indices(len(t), 1)
    dt = t[j] - t[i]
    keep = dt > 0
    return float(np.median((y[j] - y[i])[keep] / dt[keep]) * (t[-1] - t[0])) if keep.any() else 0.0


def percentile(hist: np.ndarray, q: float) -> float | None:
    """The q-th percentile (ms) of a BINS histogram (column k counts BINS[k-1] < ms <= BINS[k]):
    the upper edge of the bin holding it."""
    n = hist.sum()
    if n == 0:
        return None
    k = int(np.searchsorted(np.cumsum(hist), q / 100 * n))
    return float(BINS[min(k, len(BINS) - 1)])


def drift(windows: list[dict]) -> dict:
    """Last window's p99 against the first's, beyond the noise measured across the windows."""
    p99 = np.array([w["p99_ms"] for w in windows if w["p99_ms"] is not None])
    if len(p99) < 4:
        return {"checked": False, "reason": f"{len(p99)} latency windows; drift needs 4"}
    second = p99[2:] - 2 * p99[1:-1] + p99[:-2]
    sigma = MAD * float(np.median(np.abs(second))) / np.sqrt(6)
    limit = p99[0] * (1 + DRIFT) + NOISE_SIGMAS * sigma * np.sqrt(2)
    return {"checked": True, "first_p99_ms": float(p99[0]), "last_p99_ms": float(p99[-1]),
            "noise_sigma_ms": sigma, "limit_ms": float(limit), "drifted": bool(p99[-1] > limit)}


class Samples:
    """Resource samples in a fixed buffer: (time s, run, rss, fds, threads, device mem, mean
    latency ms, max latency ms since the last sample)."""

    def __init__(self):
        self.data = np.zeros((SAMPLES, 8))
        self.n, self.every = 0, 1

    def add(self, row) -> None:
        if self.n == SAMPLES:  # keep every other sample; sample half as often from now on
            self.data[:SAMPLES // 2] = self.data[::2]
            self.n, self.every = SAMPLES // 2, self.every * 2
        self.data[self.n] = row
        self.n += 1

    def view(self) -> np.ndarray:
        return self.data[:self.n]


class Soak:
    """One soak: run() until `runs` runs or `seconds` have passed, then summary()."""

    def __init__(self, m: Model, runs: int | None = None, seconds: float | None = None,
                 canary_every: int = 100, sample_s: float = 1.0, warmup: int = 20,
                 windows: int = 10, timeout_ms: float | None = None, rss_bound: float = 4 << 20,
                 allow_faults: int = 0, log=None, hook=None):
        self.m, self.runs, self.seconds, self.hook = m, runs, seconds, hook
        self.rss_bound, self.allow_faults = rss_bound, allow_faults
        self.canary_every, self.sample_s, self.timeout_ms = canary_every, sample_s, timeout_ms
        self.warmup = min(warmup, runs // 4) if runs else warmup
        self.log, self.lock = log, threading.Lock()
        self.feed = Feeder(m)
        self.canary_in = random_feeds(m.inputs, seed=12345)
        self.canary_out = {n: np.empty(s, d) for n, (s, d) in m.outputs.items()}
        self.reference = None
        self.hist = np.zeros((windows, len(BINS) + 1), np.int64)
        self.samples = Samples()
        self.count = dict(runs=0, timeouts=0, device_errors=0, recovered=0, canaries=0,
                          canary_mismatches=0)
        self.first_mismatch = self.broken = None
        self.serial_lines = self.serial_alerts = 0
        self.t0 = self.t_warm = time.monotonic()
        self._lat = [0.0, 0.0, 0]  # sum, max, count of latencies since the last sample

    def event(self, kind: str, **fields) -> None:
        if self.log is None:
            return
        rec = {"t": round(time.monotonic() - self.t0, 4), "event": kind, **fields}
        with self.lock:  # the serial thread logs too
            self.log.write(json.dumps(rec) + "\n")

    def run(self) -> dict:
        self.loop()
        return self.summary()

    def loop(self) -> None:
        next_sample = self.t0
        while not self._done():
            i = self.count["runs"] = self.count["runs"] + 1
            canary = i == 1 or i % self.canary_every == 0 or self.broken is not None
            self._once(i, canary)
            if i == self.warmup:
                self.t_warm = time.monotonic()
            if time.monotonic() >= next_sample:
                self._sample(i)
                next_sample = time.monotonic() + self.sample_s * self.samples.every
        self._once(self.count["runs"] + 1, canary=True)  # a last canary, after everything
        self.count["runs"] += 1
        self._sample(self.count["runs"])

    def _done(self) -> bool:
        if self.runs is not None:
            return self.count["runs"] >= self.runs - 1  # the final canary is the last run
        return time.monotonic() - self.t0 >= self.seconds

    def _once(self, i: int, canary: bool) -> None:
        if not canary:
            self.feed.before(i)
        start = time.perf_counter()
        try:
            if self.hook is not None:
                self.hook(i)  # tests inject a leak or a drift here, inside the timed run
            if canary:
                self.m.run(self.canary_in, out=self.canary_out, timeout_ms=self.timeout_ms)
            else:
                self.m.run(out=self.feed.out, timeout_ms=self.timeout_ms)
        except (DeviceTimeout, DeviceError) as e:
            kind = "timeouts" if isinstance(e, DeviceTimeout) else "device_errors"
            self.count[kind] += 1
            self.broken = i
            self.event(kind[:-1], run=i, error=f"{type(e).__name__}: {e}")
            return
        ms = (time.perf_counter() - start) * 1e3
        if self.broken is not None:
            self.count["recovered"] += 1
            self.event("recovered", run=i, failed_run=self.broken)
            self.broken = None
        self._record(i, ms)
        if canary:
            self._check_canary(i)
        else:
            self.feed.after()

    def _record(self, i: int, ms: float) -> None:
        lat = self._lat
        lat[0], lat[1], lat[2] = lat[0] + ms, max(lat[1], ms), lat[2] + 1
        if i <= self.warmup:
            return
        n = len(self.hist)
        if self.runs is not None:
            w = (i - self.warmup - 1) * n // max(self.runs - self.warmup, 1)
        else:
            span = self.seconds - (self.t_warm - self.t0)
            w = int((time.monotonic() - self.t_warm) / max(span, 1e-9) * n)
        self.hist[min(w, n - 1), np.searchsorted(BINS, ms)] += 1

    def _check_canary(self, i: int) -> None:
        self.count["canaries"] += 1
        if self.reference is None:
            self.reference = {n: a.copy() for n, a in self.canary_out.items()}
            return
        bad = [(name, got, self.reference[name]) for name, got in self.canary_out.items()
               if not np.array_equal(got.view(np.uint8), self.reference[name].view(np.uint8))]
        self.event("canary", run=i, match=not bad)
        if not bad:
            return
        self.count["canary_mismatches"] += 1
        self.first_mismatch = self.first_mismatch or i
        if self.count["canary_mismatches"] <= MAX_EVENTS:
            for name, got, want in bad:
                g, w = got.reshape(-1), want.reshape(-1)
                at = int(np.argmax(g.view(np.uint8) != w.view(np.uint8))) // got.dtype.itemsize
                self.event("canary_mismatch", run=i, output=name, element=at,
                           got=float(g[at]), want=float(w[at]))

    def _sample(self, i: int) -> None:
        rss, fds, threads, mem = resources(self.m.device)
        s, mx, n = self._lat
        mean = s / n if n else float("nan")
        self._lat = [0.0, 0.0, 0]
        t = time.monotonic() - self.t0
        self.samples.add((t, i, rss, fds, threads, mem, mean, mx if n else float("nan")))
        self.event("sample", run=i, rss=int(rss), fds=int(fds), threads=int(threads),
                   device_memory=None if np.isnan(mem) else int(mem),
                   latency_mean_ms=None if not n else round(mean, 4),
                   latency_max_ms=None if not n else round(mx, 4))

    def summary(self) -> dict:
        d = self.samples.view()
        steady = d[d[:, 1] > self.warmup] if (d[:, 1] > self.warmup).sum() >= 3 else d
        t = steady[:, 0]
        total = self.hist.sum(axis=0)
        windows = [{"window": k, "runs": int(h.sum()), "p50_ms": percentile(h, 50),
                    "p99_ms": percentile(h, 99)} for k, h in enumerate(self.hist)]
        mem = growth(t, steady[:, 5])
        s = {**self.count, "seconds": round(time.monotonic() - self.t0, 2),
             "first_mismatch_run": self.first_mismatch,
             "rss_growth_bytes": int(growth(t, steady[:, 2])),
             "fd_growth": round(growth(t, steady[:, 3]), 3),
             "thread_growth": round(growth(t, steady[:, 4]), 3),
             "device_memory_growth_bytes": None if np.isnan(d[:, 5]).all() else int(mem),
             "rss_start_bytes": int(steady[0, 2]), "rss_end_bytes": int(steady[-1, 2]),
             "p50_ms": percentile(total, 50), "p99_ms": percentile(total, 99),
             "max_ms": float(np.nanmax(d[:, 7])) if not np.isnan(d[:, 7]).all() else None,
             "windows": windows, "drift": drift(windows),
             "serial_lines": self.serial_lines, "serial_alerts": self.serial_alerts}
        s["reasons"] = reasons(s, self.rss_bound, self.allow_faults)
        s["verdict"] = "FAIL" if s["reasons"] else "OK"
        self.event("summary", **s)
        return s


def _count(n: int, noun: str, plural: str = "s") -> str:
    return f"{n} {noun}{'' if n == 1 else plural}"


def reasons(s: dict, rss_bound: float, allow_faults: int) -> list[str]:
    """Why the soak failed; empty when it did not."""
    why = []
    if s["canary_mismatches"]:
        why.append(f"{_count(s['canary_mismatches'], 'canary mismatch', 'es')}, the first at "
                   f"run {s['first_mismatch_run']}")
    faults = s["timeouts"] + s["device_errors"]
    if faults > allow_faults:
        why.append(f"{_count(s['timeouts'], 'timeout')} and "
                   f"{_count(s['device_errors'], 'device error')} (--allow-faults {allow_faults})")
    if s["rss_growth_bytes"] > rss_bound:
        why.append(f"RSS grew {s['rss_growth_bytes'] / 2**20:.1f} MiB (fitted trend), bound "
                   f"{rss_bound / 2**20:.1f} MiB")
    mem = s["device_memory_growth_bytes"]
    if mem is not None and mem > rss_bound:
        why.append(f"device memory grew {mem / 2**20:.1f} MiB (fitted trend), bound "
                   f"{rss_bound / 2**20:.1f} MiB")
    for key, what in (("fd_growth", "open fds"), ("thread_growth", "threads")):
        if s[key] > 0.5:
            why.append(f"{what} grew by {s[key]:.1f} (fitted trend), bound 0.5")
    d = s["drift"]
    if d["checked"] and d["drifted"]:
        why.append(f"latency p99 drifted {d['first_p99_ms']:.3f} -> {d['last_p99_ms']:.3f} ms, "
                   f"over the {d['limit_ms']:.3f} ms limit (first +5% + 3 sigma, sigma "
                   f"{d['noise_sigma_ms']:.3f} ms)")
    return why


class SerialLog:
    """The device's serial console on a thread, each line logged with the soak's clock."""

    def __init__(self, soak: Soak, port: str, baud: int):
        try:
            import serial  # optional: only --serial needs pyserial
        except ImportError:
            raise ToolError("--serial needs pyserial (pip install pyserial)") from None
        try:
            self.port = serial.serial_for_url(port, baudrate=baud, timeout=0.2)
        except (serial.SerialException, ValueError) as e:
            raise ToolError(f"--serial {port}: {e}") from None
        self.soak, self.stop = soak, threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True, name="soak-serial")
        self.thread.start()

    def _read(self) -> None:
        while not self.stop.is_set():
            try:
                raw = self.port.readline()  # at most the port's 0.2 s timeout
            except Exception as e:  # noqa: BLE001 - a pulled cable ends the capture, not the soak
                self.soak.event("serial_error", error=f"{type(e).__name__}: {e}")
                return
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if line:
                alert = bool(ALERT.search(line))
                self.soak.serial_lines += 1
                self.soak.serial_alerts += alert
                self.soak.event("serial", line=line, alert=alert, run=self.soak.count["runs"])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(1.0)
        self.port.close()


class ToolError(Exception):
    pass


def report(s: dict) -> str:
    ms = lambda x: "n/a" if x is None else f"{x:.2f} ms"  # noqa: E731
    d = s["drift"]
    drift_line = (f"p99 first window {ms(d['first_p99_ms'])}, last {ms(d['last_p99_ms'])}, "
                  f"limit {ms(d['limit_ms'])} (noise sigma {ms(d['noise_sigma_ms'])})"
                  if d["checked"] else f"drift not checked: {d['reason']}")
    mem = s["device_memory_growth_bytes"]
    lines = [
        f"runs {s['runs']} in {s['seconds']:.0f} s: latency p50 {ms(s['p50_ms'])}, p99 "
        f"{ms(s['p99_ms'])}, max {ms(s['max_ms'])}",
        drift_line,
        f"canaries {s['canaries']}, mismatches {s['canary_mismatches']}",
        f"faults: timeouts {s['timeouts']}, device errors {s['device_errors']}, recovered "
        f"{s['recovered']}",
        f"growth (fitted): RSS {s['rss_growth_bytes'] / 2**20:+.2f} MiB "
        f"({s['rss_start_bytes'] / 2**20:.1f} -> {s['rss_end_bytes'] / 2**20:.1f} MiB), fds "
        f"{s['fd_growth']:+.2f}, threads {s['thread_growth']:+.2f}, device memory "
        f"{'not reported by this backend' if mem is None else f'{mem / 2**20:+.2f} MiB'}",
    ]
    if s["serial_lines"]:
        lines.append(f"serial: {s['serial_lines']} lines, {s['serial_alerts']} alerts")
    verdict = "OK" if s["verdict"] == "OK" else "FAIL: " + "; ".join(s["reasons"])
    return "\n".join(lines + [f"verdict: {verdict}"])


def plot(soak: Soak, path: str, title: str) -> str:
    d = soak.samples.view()
    return plot_png(path, title, [
        ("latency ms", d[:, 0], {"mean": d[:, 6], "max": d[:, 7]}),
        ("RSS MiB", d[:, 0], {"rss": d[:, 2] / 2**20}),
    ])


MAX_HOURS, MAX_SAMPLE_S, MAX_WINDOWS, MAX_RSS_MB, MAX_BAUD = 10**5, 86400.0, 10**6, 1e9, 10**8


def parse_args():
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("blob")
    ap.add_argument("--device", help="cpu, opencl, mock, ... (default: the blob's target's)")
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--runs", type=positive_int, help="default 1000")
    length.add_argument("--hours", type=number(float, 0, MAX_HOURS, low_open=True))
    ap.add_argument("--canary-every", type=positive_int, default=100, metavar="K")
    ap.add_argument("--sample-s", type=number(float, 0, MAX_SAMPLE_S, low_open=True),
                    default=1.0, help="resource sampling")
    ap.add_argument("--warmup", type=non_negative_int, default=20, help="runs left out of trends")
    ap.add_argument("--windows", type=number(int, 1, MAX_WINDOWS), default=10,
                    help="latency windows")
    ap.add_argument("--timeout-ms", type=timeout_ms, help="run deadline (default 2000)")
    ap.add_argument("--rss-bound-mb", type=number(float, 0, MAX_RSS_MB, low_open=True),
                    default=4.0)
    ap.add_argument("--allow-faults", type=non_negative_int, default=0,
                    help="faults that do not fail it")
    ap.add_argument("--serial", metavar="PORT", help="capture this serial console (pyserial)")
    ap.add_argument("--baud", type=number(int, 1, MAX_BAUD), default=115200)
    ap.add_argument("--log", default="soak.jsonl", help="JSONL log (default soak.jsonl)")
    ap.add_argument("--plot", default="soak.png", help="PNG of latency and RSS (default soak.png)")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    runs = None if args.hours else (args.runs or 1000)
    try:
        m = Model.load(args.blob, device=args.device)
    except (BlobError, ConfigError, DeviceError, ValueError) as e:  # ValueError: bad --device
        print(f"soak: {args.blob}: {e}", file=sys.stderr)
        return 2
    try:
        for path in (args.log, args.plot):
            check_output(path, inputs=[args.blob])
            if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise FileNotFoundError(errno.ENOENT, "its folder does not exist", path)
        if os.path.abspath(args.log) == os.path.abspath(args.plot):
            raise FileExistsError(errno.EEXIST, "is also the --log", args.plot)
        log = open(args.log, "w", buffering=1)  # line-buffered: a killed soak keeps its log
    except OSError as e:
        print(f"soak: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    with log:
        soak = Soak(m, runs, args.hours and args.hours * 3600, args.canary_every, args.sample_s,
                    args.warmup, args.windows, args.timeout_ms, args.rss_bound_mb * 2**20,
                    args.allow_faults, log)
        soak.event("start", blob=os.path.abspath(args.blob), device=m.device.name,
                   runs=runs, hours=args.hours, argv=sys.argv[1:],
                   wall_time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        try:
            serial_log = args.serial and SerialLog(soak, args.serial, args.baud)
        except ToolError as e:
            print(f"soak: {e}", file=sys.stderr)
            return 2
        try:
            soak.loop()
        except KeyboardInterrupt:  # Ctrl-C ends an hours-long soak early, with its summary
            soak.event("interrupted", run=soak.count["runs"])
        finally:
            if serial_log:
                serial_log.close()
        s = soak.summary()
    s["log"], s["plot"] = args.log, args.plot
    try:
        s["plot_renderer"] = plot(soak, args.plot, f"soak {os.path.basename(args.blob)} "
                                  f"{m.device.name} {s['verdict']}")
    except OSError as e:  # the disk filled during the soak: the log has what it saw
        print(f"soak: {e.filename or args.plot}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(json.dumps(s) if args.json else report(s) + f"\nlog {args.log}, plot {args.plot}")
    return 0 if s["verdict"] == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
