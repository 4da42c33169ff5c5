"""keel runner: load a .blob and run it. Depends on numpy, cffi and the standard library only."""
from runner.errors import (AllocError, BlobError, ConfigError, DeviceError, DeviceTimeout,
                           InputError)
from runner.model import Model

__all__ = ["Model", "BlobError", "AllocError", "ConfigError", "InputError", "DeviceTimeout",
           "DeviceError"]
