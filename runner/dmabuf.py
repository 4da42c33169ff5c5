"""DmaBuf: a camera buffer that already lives in device-visible memory, named by its dma-buf fd.

openpilot's VisionIPC hands out frames as ION buffers (on the comma 3X's 4.9 kernel ION buffers
are dma-bufs) from a small ring it reuses. Model.bind_input(name, DmaBuf(fd, offset, nbytes))
binds one to an input through the device contract's bind_device (runner/device.py): a backend
that can import dma-bufs (qcom, through KGSL) maps the buffer once per fd, zero-copy, and keeps
that import until the device closes; one that cannot raises DeviceError.

The caller keeps the fd open while it is bound and never reuses its number for another buffer
while the Model lives: the import is found again by fd number (on 4.9 every dma-buf shares one
anonymous inode, so nothing finer identifies a buffer).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class DmaBuf(NamedTuple):
    fd: int  # the dma-buf (ION buffer) file descriptor
    offset: int  # where the input's bytes start in the buffer (VisionIPC: a plane's offset)
    nbytes: int  # how many bytes the input reads from there: the input's size
    dtype: np.dtype = np.dtype(np.uint8)  # what the bytes are: camera planes are uint8
