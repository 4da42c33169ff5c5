"""The one DeviceError qcom raises: the runtime core's when it has one, else a local stand-in."""
try:
    from runner.errors import DeviceError
except ImportError:  # the runtime core's device contract has not landed yet
    class DeviceError(RuntimeError):
        """A device call failed: names the call, the errno and what was asked."""
