"""The disk tier across processes: a writer SIGKILLed mid-write never leaves a corrupt entry; two
processes share one directory under one budget."""

from __future__ import annotations

import inspect
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from contextdeque.stores import (
    DiskTier,
    StoreEntry,
)
from store_helpers import (
    disk_file_size,
    make_entry,
    same,
)


# ----------------------------------------------------------------------------- processes

# A long-lived helper process imports torch once and forks writers on demand, so that
# dozens of SIGKILLed writers cost milliseconds each instead of an interpreter start.
ZYGOTE = (
    textwrap.dedent(
        """
        import os, sys, traceback
        import torch
        torch.set_num_threads(1)
        from contextdeque.core.errors import CollisionError
        from contextdeque.stores import DiskTier, StoreEntry
        """
    )
    + inspect.getsource(make_entry)
    + textwrap.dedent(
        """
        def crash_writer(path, out, start, nkeys, nbytes):
            tier = DiskTier(path, None, stale_tmp_s=1e9)
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            i = start
            while True:
                key = f"k{i % nkeys:03d}"
                tier.put(key, make_entry(i, nbytes), overwrite=True)
                os.write(fd, f"{key} {i}\\n".encode())  # printed only after put returned
                i += 1

        def concurrent_writer(path, out, tag, n, nbytes, budget):
            budget = None if budget == "none" else int(budget)
            tier = DiskTier(path, budget)
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            base = 1000 if tag == "A" else 2000
            for i in range(n):
                tier.put(f"{tag}-{i:03d}", make_entry(base + i, nbytes))
                tier.put(f"shared-{i % 5}", make_entry(i % 5, nbytes))  # same content in both
                if i == n // 2:
                    try:  # same key, different content: exactly one writer may win
                        tier.put("clash", make_entry(base, nbytes))
                        os.write(fd, b"clash-won\\n")
                    except CollisionError:
                        os.write(fd, b"clash-refused\\n")
                if budget is not None and tier.nbytes() > budget:
                    os.write(fd, b"OVER-BUDGET\\n")
            os.write(fd, b"done\\n")

        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "fork":
                pid = os.fork()
                if pid == 0:
                    code = 0
                    try:
                        argv = [int(a) if a.isdigit() else a for a in args[1:]]
                        globals()[args[0]](*argv)
                    except BaseException:
                        traceback.print_exc()
                        code = 1
                    os._exit(code)
                print(pid, flush=True)
            elif cmd == "reap":
                _, status = os.waitpid(int(args[0]), 0)
                print(status, flush=True)
        """
    )
)


class Zygote:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def _ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply, f"zygote died (rc={self.proc.poll()})"
        return reply.strip()

    def fork(self, *args: object) -> int:
        return int(self._ask("fork " + " ".join(str(a) for a in args)))

    def reap(self, pid: int) -> int:
        """Wait for a child; returns its raw wait status."""
        return int(self._ask(f"reap {pid}"))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def _confirmed(out: Path) -> dict[str, int]:
    """key -> highest version whose put returned (complete lines only)."""
    best: dict[str, int] = {}
    if not out.exists():
        return best
    for line in out.read_text().splitlines(keepends=True):
        if not line.endswith("\n"):
            continue  # killed mid-print: not a confirmation
        key, v = line.split()
        best[key] = max(best.get(key, -1), int(v))
    return best


def _check_read(tier: DiskTier, key: str, nbytes: int, full: bool = True) -> StoreEntry | None:
    """A read is either absent or the complete entry some version wrote; never corrupt.

    ``full`` regenerates the version's content and compares it; otherwise the store's own
    verification (checksums) plus the metadata must agree (cheap, while a writer runs).
    """
    got = tier.get(key)  # CorruptEntryError here fails the test
    if got is not None:
        version = int(got.meta["version"])
        if full:
            assert same(got, make_entry(version, nbytes)), key
        else:
            payload = 4 * max(nbytes // 4 - 64, 1) + 4 * 16 * 2  # x (int32) + y (bf16), see make_entry
            assert got.content_digest == f"digest-{version:08d}" and got.nbytes == payload, key
    return got


def test_sigkill_mid_write_never_leaves_corrupt_entries(tmp_path: Path, zygote: Zygote) -> None:
    nkeys, nbytes, kills = 12, 3 * 1024 * 1024, 60
    path, out = tmp_path / "store", tmp_path / "confirmed.txt"
    reader = DiskTier(path, None, stale_tmp_s=1e9)
    rng = random.Random(7)
    start = 0
    for _ in range(kills):
        pid = zygote.fork("crash_writer", path, out, start, nkeys, nbytes)
        deadline = time.monotonic() + rng.uniform(0.0, 0.25)
        while time.monotonic() < deadline:  # read concurrently with the writer
            _check_read(reader, f"k{rng.randrange(nkeys):03d}", nbytes, full=False)
            time.sleep(0.01)  # leave the writer CPU on a 2-core machine
        os.kill(pid, signal.SIGKILL)
        status = zygote.reap(pid)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        start += 1000  # versions of each writer are distinct
    confirmed = _confirmed(out)
    assert len(confirmed) > 0
    for key, version in confirmed.items():
        got = _check_read(reader, key, nbytes)
        assert got is not None, f"{key} was confirmed (v{version}) but is gone"
        assert int(got.meta["version"]) >= version  # a later complete version may replace it
    for i in range(nkeys):
        _check_read(reader, f"k{i:03d}", nbytes)
    assert reader.scrub() == []  # every committed file verifies
    temps = list(path.glob(".tmp-*"))
    assert temps, "no kill landed mid-write: the test did not exercise what it claims"
    assert reader.clean_temp(min_age_s=0) == len(temps)
    assert list(path.glob(".tmp-*")) == []
    files = list(path.glob("*.safetensors"))
    assert reader.nbytes() == sum(p.stat().st_size for p in files) and len(files) == len(reader.keys())


@pytest.mark.parametrize("budget_entries", [None, 8])
def test_two_processes_share_one_disk_store(tmp_path: Path, zygote: Zygote, budget_entries: int | None) -> None:
    nbytes, n = 512 * 1024, 40
    path = tmp_path / "store"
    size = disk_file_size(tmp_path, make_entry(1000, nbytes), key="A-000")
    budget = None if budget_entries is None else size * budget_entries
    outs = [tmp_path / "A.txt", tmp_path / "B.txt"]
    pids = [
        zygote.fork("concurrent_writer", path, outs[0], "A", n, nbytes, budget or "none"),
        zygote.fork("concurrent_writer", path, outs[1], "B", n, nbytes, budget or "none"),
    ]
    statuses = [zygote.reap(p) for p in pids]
    assert all(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in statuses), statuses
    logs = [o.read_text().split() for o in outs]
    assert all(log[-1] == "done" and "OVER-BUDGET" not in log for log in logs), logs
    tier = DiskTier(path, budget)
    assert tier.scrub() == []
    keys = tier.keys()
    for key in keys:
        got = tier.get(key)
        assert got is not None and same(got, make_entry(int(got.meta["version"]), nbytes))
    files = list(path.glob("*.safetensors"))
    assert tier.nbytes() == sum(p.stat().st_size for p in files) and len(files) == len(keys)
    assert list(path.glob(".tmp-*")) == [] and list(path.glob("*.pin")) == []
    clash = sorted(w for log in logs for w in log if w.startswith("clash"))
    if budget is None:
        expected = {f"{t}-{i:03d}" for t in "AB" for i in range(n)} | {f"shared-{i}" for i in range(5)} | {"clash"}
        assert set(keys) == expected
        assert clash == ["clash-refused", "clash-won"]
    else:
        assert tier.nbytes() <= budget
        assert len(clash) == 2
