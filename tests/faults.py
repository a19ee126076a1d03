"""Store fault injection for tests: a read-only directory, a full disk, a write that fails
half-way. Faults are injected at the operating-system calls the disk tier makes, for paths under
one directory only, so the code under test runs its real error paths."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Iterator

FAULTS = ("readonly", "enospc", "halfway")

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class _HalfWriter:
    """A file object that writes half of what it is given, then fails."""

    def __init__(self, f, exc: OSError) -> None:
        self._f, self._exc = f, exc

    def write(self, data) -> int:
        self._f.write(bytes(data)[: len(data) // 2])
        self._f.flush()
        raise self._exc

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


@contextlib.contextmanager
def inject(fault: str, root: str | os.PathLike[str]) -> Iterator[None]:
    """While active, file-system writes under ``root`` fail as ``fault`` says:

    - ``readonly``: creating, renaming or removing anything raises ``PermissionError(EACCES)``
      (opening for writing included), as in a directory made read-only;
    - ``enospc``: data writes store half their bytes, then raise ``OSError(ENOSPC)``;
    - ``halfway``: data writes store half their bytes, then raise ``OSError(EIO)``.
    Reads are untouched."""
    assert fault in FAULTS, fault
    base = str(Path(root).resolve())

    def under(path) -> bool:
        try:
            p = os.path.realpath(os.fspath(path)) if not isinstance(path, int) else os.readlink(f"/proc/self/fd/{path}")
        except (TypeError, OSError):
            return False
        return p == base or p.startswith(base + os.sep)

    real = {n: getattr(os, n) for n in ("open", "replace", "rename", "unlink", "remove", "mkdir", "rmdir", "fdopen")}

    def deny(name):
        def f(*a, **k):
            if under(a[0]) or (name in ("replace", "rename") and under(a[1])):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(a[0]))
            return real[name](*a, **k)
        return f

    def ro_open(path, flags, *a, **k):
        if flags & _WRITE_FLAGS and under(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real["open"](path, flags, *a, **k)

    code = errno.ENOSPC if fault == "enospc" else errno.EIO

    def half_fdopen(fd, mode="r", *a, **k):
        f = real["fdopen"](fd, mode, *a, **k)
        if any(c in mode for c in "wa+") and under(fd if isinstance(fd, int) else -1):
            return _HalfWriter(f, OSError(code, os.strerror(code)))
        return f

    patched = (
        {"open": ro_open, **{n: deny(n) for n in ("replace", "rename", "unlink", "remove", "mkdir", "rmdir")}}
        if fault == "readonly"
        else {"fdopen": half_fdopen}
    )
    for n, f in patched.items():
        setattr(os, n, f)
    try:
        yield
    finally:
        for n in patched:
            setattr(os, n, real[n])
