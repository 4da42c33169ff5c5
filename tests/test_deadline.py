"""Deadlines never lie (runner/device.py: wait_until). A submission that completes by its deadline
is never a timeout; one that has not is reported within 2 ms of the deadline; no blocking call
sleeps past it. Proven on a fake clock over 10,000 random trials, fast, with no real sleeping."""
from __future__ import annotations

import random

import pytest

from runner import DeviceTimeout
from runner.device import MAX_SLEEP_S, wait_until

TRIALS = 10_000
REPORT_WITHIN_S = 0.002  # the bound: a hang is reported by timeout_ms + 2 ms


class Device:
    """A fake device and clock. The device completes at `done_at`; a blocking wait wakes at its
    slice's end or at completion, whichever is first (as a condition variable does). With
    `preempt`, each clock read may first lose up to 5 ms to another process (the caller is
    descheduled between reading the clock and acting on it)."""

    def __init__(self, rng: random.Random, done_at: float, preempt: bool):
        self.rng, self.done_at, self.preempt = rng, done_at, preempt
        self.now, self.overslept, self.slices = 0.0, [], []

    def clock(self) -> float:
        if self.preempt and self.rng.random() < 0.3:
            self.now += self.rng.uniform(0, 0.005)
        return self.now

    def done(self) -> bool:
        return self.now >= self.done_at

    def block(self, seconds: float, deadline: float) -> None:
        end = self.now + seconds
        self.slices.append(seconds)
        self.overslept.append(end - deadline)
        self.now = min(end, self.done_at) if self.done_at > self.now else end


def _trial(rng: random.Random, preempt: bool) -> tuple[bool, Device, float]:
    timeout = rng.uniform(0.001, 0.1)
    # completion around the deadline: before, exactly at, just after, or never
    done_at = rng.choice([timeout + rng.uniform(-0.003, 0.003), timeout, timeout + 1e-9,
                          float("inf")])
    dev = Device(rng, done_at, preempt)
    deadline = timeout  # measured from submit, at clock 0
    try:
        wait_until(dev.done, deadline, "fake", dev.clock, lambda s: dev.block(s, deadline))
        return True, dev, deadline
    except DeviceTimeout:
        return False, dev, deadline


@pytest.mark.parametrize("preempt", [False, True], ids=["quiet", "preempted"])
def test_10000_trials_around_the_deadline_give_no_false_and_no_missed_timeouts(preempt):
    rng = random.Random(17 + preempt)
    false_timeouts = missed = late = overslept = 0
    for _ in range(TRIALS):
        completed, dev, deadline = _trial(rng, preempt)
        in_time = dev.done_at <= deadline
        false_timeouts += in_time and not completed
        # "completed" must mean the device had completed when wait returned
        missed += completed and not dev.done()
        if not completed:
            late += dev.now - deadline > REPORT_WITHIN_S and not preempt
            # a timeout is only ever reported once the device has still not completed
            missed += dev.done()
        overslept += any(o > 1e-12 for o in dev.overslept)  # 1e-12: float rounding
    assert (false_timeouts, missed, late, overslept) == (0, 0, 0, 0)


def test_without_preemption_every_late_completion_is_a_timeout_reported_at_the_deadline():
    rng = random.Random(3)
    for _ in range(TRIALS):
        completed, dev, deadline = _trial(rng, preempt=False)
        assert completed == (dev.done_at <= deadline)
        if not completed:
            assert 0 <= dev.now - deadline <= REPORT_WITHIN_S
        assert all(o <= 1e-12 for o in dev.overslept)  # float rounding of now + remaining
        assert all(0 < s <= MAX_SLEEP_S for s in dev.slices)


def test_completion_while_descheduled_past_the_deadline_is_not_a_timeout():
    """tinygrad's QCOM bug: the clock is read after the condition, the process sleeps past the
    deadline in between, and a finished run is called a timeout. Here the clock is read first,
    then the condition is checked again."""
    state = {"now": 0.0, "reads": 0}

    def clock():
        state["reads"] += 1
        state["now"] = 1.0  # descheduled for a second right at this read
        return state["now"]

    done = lambda: state["now"] >= 0.5  # noqa: E731  completes while we are descheduled
    wait_until(done, 0.010, "fake", clock, lambda s: None)
    assert state["reads"] == 1
