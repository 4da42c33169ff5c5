"""keel runner: load a .blob and run it. Depends on numpy, cffi and the standard library only."""
from runner.errors import (AllocError, BlobError, ConfigError, DeviceError, DeviceTimeout,
                           InputError)
from runner.dmabuf import DmaBuf
from runner.model import Model

__all__ = ["Model", "DmaBuf", "BlobError", "AllocError", "ConfigError", "InputError",
           "DeviceTimeout", "DeviceError"]
