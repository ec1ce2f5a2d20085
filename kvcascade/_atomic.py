"""Replace a small file atomically: a temp file beside it, then ``os.replace``.

A reader sees the old file or the new one, never a part. The temp file is
``<path>_<pid>_<random>.tmp`` (the name the fs tier's start-up scan recognises as a temp file
and deletes once its writer is gone, docs/fs-tier.md "Restart"), opened ``O_CREAT | O_EXCL``
with mode 0600 (KV bytes and policy statistics reveal prompts).
"""

from __future__ import annotations

import contextlib
import os
import secrets

#: Most bytes the temp name adds to the file name: ``_<pid>_<random>.tmp`` with a pid of at most
#: 7 digits (Linux's ``pid_max`` limit 2**22) and a 63-bit random number (19 digits).
TEMP_SUFFIX_MAX_BYTES = len("_4194304_") + len(str(2**63 - 1)) + len(".tmp")


def replace_file(path: str | os.PathLike[str], data: bytes, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` atomically, mode 0600.

    ``fsync``: flush the temp file to stable storage before the rename (a file that must
    survive a power loss, not only a process crash).

    Raises:
        OSError: the file cannot be written (the temp file is removed).
    """
    target = os.fspath(path)
    tmp = f"{target}_{os.getpid()}_{secrets.randbits(63)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
