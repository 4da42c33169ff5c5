"""One checked open for every path keel reads: the runner's blob, the compiler's model, the
tools' inputs. Only a regular file is read: open(2) of a FIFO blocks until a writer comes, and a
device node or a directory is never what was meant."""
from __future__ import annotations

import errno
import os
import stat

KINDS = [(stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISSOCK, "a socket")]


def kind(mode: int) -> str:
    return next((k for test, k in KINDS if test(mode)), "not a regular file")


def open_regular(path) -> int:
    """A read-only fd of `path`, a regular file (symlinks to one are followed). Raises OSError
    naming the path for anything else, a path with a NUL byte included. O_NONBLOCK: opening a
    FIFO returns at once, so fstat can refuse it; on a regular file the flag does nothing."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"expected a path (str or os.PathLike), got {type(path).__name__} "
                        f"{path!r}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except ValueError:  # os.open's message for a NUL byte names no path
        raise OSError(errno.EINVAL, "path contains a NUL byte", repr(os.fspath(path))) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"is {kind(mode)}, expected a regular file", os.fspath(path))
    return fd


def read_regular(path) -> bytes:
    """The whole of a regular file (open_regular)."""
    with open(open_regular(path), "rb") as f:
        return f.read()


def check_output(path, inputs=()) -> None:
    """Raise FileExistsError unless `path` may be replaced by a regular file: it does not exist
    or is a regular file, and it is none of `inputs` (the files the tool reads: `-o model.onnx`
    would replace the model). Replacing a device node, a FIFO or a symlink's name would turn
    it into a regular file (as root, even /dev/null), and a directory cannot be replaced."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except ValueError:  # a NUL byte
        raise OSError(errno.EINVAL, "path contains a NUL byte", repr(os.fspath(path))) from None
    if not stat.S_ISREG(st.st_mode):
        raise FileExistsError(errno.EEXIST, f"exists and is {kind(st.st_mode)}; not replacing it",
                              os.fspath(path))
    for src in inputs:
        try:
            same = os.path.samefile(src, path)
        except (OSError, ValueError):  # the input is missing: its own error says so
            same = False
        if same:
            raise FileExistsError(errno.EEXIST, f"is the input {os.fspath(src)}; not replacing "
                                  f"it", os.fspath(path))
