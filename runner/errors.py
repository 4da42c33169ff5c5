"""The runner's typed errors. Messages name the thing, the expected value and the received one."""


class BlobError(Exception):
    """The blob cannot be used: unreadable, corrupt, inconsistent, or built for another host."""


class AllocError(BlobError, MemoryError):
    """The memory the blob needs (arena, input slots) cannot be had on this host."""


class ConfigError(ValueError):
    """An environment setting (KEEL_THREADS, KEEL_MOCK_FAULTS, ...) is malformed."""


class InputError(ValueError):
    """run() got feeds or out= arrays that do not match the model's inputs or outputs."""


class DeviceTimeout(TimeoutError):
    """A submission did not finish before its deadline."""


class DeviceError(RuntimeError):
    """The device failed at run time: a fault, a lost device, a driver call that failed. The
    next run() recovers the device first (runner/device.py: recover)."""
    errno: int | None = None  # the kernel's errno, where a driver call failed with one
