"""Whole-file writes a reader never sees half of: a temporary file in the same folder, fsync'ed, then
`os.replace` over the target (atomic on POSIX and Windows). A writer killed at any moment leaves either the
previous file or the new one, and at worst a stray `.NAME.*.tmp` beside it.

Every document a reader opens whole goes through here: `manifest.json`, `verdict.json`, `summary.txt`,
`report.html`, `index.html`, comparison and mapping files. Logs appended a line at a time (`metrics.jsonl`,
`completions.jsonl`, `rollouts.jsonl`) are not: their readers skip a truncated last line instead.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_MODE = 0o666 & ~_umask()  # what open() would have given a new file (mkstemp makes it 0600)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", encoding: str | None = "utf-8"):
    """`with atomic_open(path) as fh: ...`: `path` appears, whole, when the block ends without an exception."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _MODE)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_open(path, "wb") as fh:
        fh.write(data)
    return Path(path)


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    with atomic_open(path, "w", encoding=encoding) as fh:
        fh.write(text)
    return Path(path)
