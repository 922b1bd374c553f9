"""A file's identity (device, inode, size, mtime): what bankml checks again before every answer.

A model file replaced, rewritten or touched after it was verified has a different identity, so
the gateway can refuse to answer for a file it did not hash.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class FileIdent:
    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> FileIdent:
        """The identity of the file at path, following symlinks (the file the engine will open)."""
        st = os.stat(path)
        return cls(dev=st.st_dev, ino=st.st_ino, size=st.st_size, mtime_ns=st.st_mtime_ns)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
