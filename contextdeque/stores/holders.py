"""Who holds a lease on a shared directory, and whether that holder still lives.

A holder is named ``<pid>-<process start>-<host>-<nonce>`` (see `contextdeque.stores.disk`): on
this host a lease lasts while that very process lives (the pid alive *and* the same start time, so
a recycled pid does not keep it); from another host (a shared network directory) while its holder
renews it within the lease TTL. The process facts come from /proc where it exists.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
from pathlib import Path


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return True
    return True


def proc_stat(pid: int) -> tuple[str, str]:
    """``(state, start time in clock ticks since boot)`` of process ``pid`` from /proc; ``("", "")``
    where /proc is not there or the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return "", ""
    fields = stat[stat.rfind(")") + 2 :].split()
    return (fields[0], fields[19]) if len(fields) > 19 else ("", "")


def proc_start(pid: int) -> str:
    return proc_stat(pid)[1]


_HOST_ID: str | None = None


def host_id() -> str:
    """12 hex chars naming this host *and boot* (hostname + kernel boot id): leases of a host
    that rebooted are the leases of dead processes."""
    global _HOST_ID
    if _HOST_ID is None:
        boot = ""
        with contextlib.suppress(OSError):
            boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        _HOST_ID = hashlib.sha256(f"{socket.gethostname()}\0{boot}".encode()).hexdigest()[:12]
    return _HOST_ID


def holder_alive(holder: str, mtime: float, lease_ttl_s: float | None, now: float | None = None) -> bool:
    """Whether the lease ``holder`` (see the module docstring) still holds.

    Same host: the process lives and started when the lease says. Another host: its holder
    renewed it (the marker's mtime) within ``lease_ttl_s``; without a TTL it always holds."""
    parts = holder.split("-")
    if not parts[0].isdigit():
        return False
    pid = int(parts[0])
    if len(parts) < 3 or parts[2] == host_id():
        if not pid_alive(pid):
            return False
        state, now_start = proc_stat(pid)
        if state in ("Z", "X"):  # killed, not yet reaped: dead
            return False
        start = parts[1] if len(parts) > 1 else ""
        return not start or not now_start or start == now_start  # a recycled pid started later
    if lease_ttl_s is None:
        return True
    return (time.time() if now is None else now) - mtime < lease_ttl_s
