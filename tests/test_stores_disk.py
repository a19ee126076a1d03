"""The disk tier's safety: every corruption detected, quarantine, accounting from the directory,
pins of live processes, permissions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from contextdeque.core.errors import (
    CorruptEntryError,
    StoreCapacityError,
    StorePermissionError,
)
from contextdeque.stores import (
    DiskTier,
    HostTier,
    TieredStore,
)
from contextdeque.stores.disk import key_digest
from store_helpers import (
    disk_file_size,
    same,
    small,
)


# ----------------------------------------------------------------------------- disk safety


def _stored(tmp_path: Path) -> tuple[DiskTier, Path, bytes]:
    tier = DiskTier(tmp_path / "d", None)
    tier.put("k", small(3))
    path = tier.file_for("k")
    return tier, path, path.read_bytes()


def test_every_flipped_byte_is_detected(tmp_path: Path) -> None:
    tier, path, good = _stored(tmp_path)
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 0xFF
        path.write_bytes(bytes(bad))
        with pytest.raises(CorruptEntryError):
            tier.get("k")
        assert not tier.verify("k")
    # one named case each: data section and header metadata
    bad = bytearray(good)
    bad[-3] ^= 0x01
    path.write_bytes(bytes(bad))
    with pytest.raises(CorruptEntryError, match="data checksum"):
        tier.get("k")


def test_metadata_edit_is_detected(tmp_path: Path) -> None:
    tier, path, good = _stored(tmp_path)
    assert b'"fp-A"' in good
    path.write_bytes(good.replace(b'"fp-A"', b'"fp-B"'))  # still valid JSON and safetensors
    with pytest.raises(CorruptEntryError, match="header checksum"):
        tier.get("k")
    with pytest.raises(CorruptEntryError):
        tier.peek("k")


def test_truncated_file_is_detected_at_every_length(tmp_path: Path) -> None:
    tier, path, good = _stored(tmp_path)
    for n in range(len(good)):
        path.write_bytes(good[:n])
        with pytest.raises(CorruptEntryError):
            tier.get("k")
    path.write_bytes(good + b"\0")
    with pytest.raises(CorruptEntryError):
        tier.get("k")
    path.write_bytes(good)
    got = tier.get("k")
    assert got is not None and same(got, small(3))


def test_foreign_and_misplaced_files_are_corrupt(tmp_path: Path) -> None:
    tier, path, good = _stored(tmp_path)
    safetensors.torch.save_file({"x": torch.zeros(3)}, str(path), metadata={"fingerprint": "fp-A"})
    with pytest.raises(CorruptEntryError, match="not a contextdeque"):
        tier.get("k")
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(CorruptEntryError):
        tier.get("k")
    tier.file_for("other").write_bytes(good)  # a valid file under another key's name
    with pytest.raises(CorruptEntryError, match="holds key"):
        tier.get("other")
    assert "other" not in tier.keys()


def test_corrupt_ok_treats_corrupt_as_absent(tmp_path: Path) -> None:
    tier, path, good = _stored(tmp_path)
    path.write_bytes(good[:-10])
    assert tier.get("k", corrupt_ok=True) is None
    assert not path.exists()  # the bad copy is discarded
    assert tier.get("k") is None
    tier.put("k", small(3))
    path.write_bytes(good[:20])
    tier.put("k", small(3))  # a put over a corrupt file replaces it (no false collision)
    got = tier.get("k")
    assert got is not None and same(got, small(3))
    # in a tiered store, a corrupt slow copy falls through to "absent" only when asked
    store = TieredStore([HostTier(1000), tier])
    path.write_bytes(good[:-1])
    with pytest.raises(CorruptEntryError):
        store.get("k")
    assert store.get("k", corrupt_ok=True) is None and store.last_traffic.misses == 1


def test_scrub_and_corrupt_files_are_evicted_first(tmp_path: Path) -> None:
    size = disk_file_size(tmp_path, small(0), key="k000")
    tier = DiskTier(tmp_path / "d", int(size * 3.5))
    for i in range(3):
        tier.put(f"k{i:03d}", small(i))
    tier.file_for("k002").write_bytes(b"\xff" * size)  # the newest file, but garbage
    res = tier.put("k003", small(3))
    assert res.evicted == () and not tier.file_for("k002").exists()  # garbage went first
    good = tier.file_for("k001").read_bytes()
    tier.file_for("k001").write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # header intact, data not
    assert tier.scrub() == [key_digest("k001") + ".safetensors"]
    assert sorted(tier.keys()) == ["k000", "k003"]
    assert tier.nbytes() == 2 * size


def test_accounting_is_recomputed_from_the_directory(tmp_path: Path) -> None:
    size = disk_file_size(tmp_path, small(0), key="k000")
    a = DiskTier(tmp_path / "d", int(size * 3.5))
    b = DiskTier(tmp_path / "d", int(size * 3.5))
    for i in range(3):
        a.put(f"k{i:03d}", small(i))
    assert b.nbytes() == 3 * size and sorted(b.keys()) == ["k000", "k001", "k002"]
    a.file_for("k001").unlink()  # removed behind both instances' backs
    assert a.nbytes() == b.nbytes() == 2 * size
    b.put("k003", small(3))
    b.put("k004", small(4))  # b's eviction sees a's files and a's recency
    assert sorted(a.keys()) == ["k002", "k003", "k004"]
    assert a.nbytes() <= a.budget_bytes


def test_disk_pins_follow_live_processes(tmp_path: Path) -> None:
    size = disk_file_size(tmp_path, small(0), key="k000")
    tier = DiskTier(tmp_path / "d", int(size * 2.5))
    tier.put("k000", small(0))
    tier.put("k001", small(1))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stem0, stem1 = key_digest("k000"), key_digest("k001")
    (tier.path / f"{stem0}.{dead.pid}.pin").touch()  # a pin left by a crashed process
    (tier.path / f"{stem1}.{os.getppid()}.pin").touch()  # a pin held by a live process
    assert not tier.is_pinned("k000") and tier.is_pinned("k001")
    assert [e.key for e in tier.put("k002", small(2)).evicted] == ["k000"]
    assert tier.pin("k002")
    with pytest.raises(StoreCapacityError):
        tier.put("k003", small(3))  # the rest is pinned (one live pin each)
    assert not (tier.path / f"{stem0}.{dead.pid}.pin").exists()  # stale marker cleaned


def test_permission_path_under_a_regular_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("not a directory")
    with pytest.raises(StorePermissionError, match="cannot create store directory"):
        DiskTier(f / "sub", None)
    with pytest.raises(StorePermissionError, match="not a directory"):
        DiskTier(f, None)


def test_permission_read_only_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        if os.geteuid() == 0:
            # root ignores mode bits; make os.access answer what the mode says for this path
            # (DiskTier's own check still runs and raises).
            real_access = os.access

            def access(path, mode, *a, **kw):  # type: ignore[no-untyped-def]
                if Path(path) == d and mode & os.W_OK:
                    return False
                return real_access(path, mode, *a, **kw)

            monkeypatch.setattr(os, "access", access)
        with pytest.raises(StorePermissionError, match="not readable and writable") as ei:
            DiskTier(d, None)
        assert "0o500" in str(ei.value) and isinstance(ei.value, PermissionError)
    finally:
        d.chmod(0o700)


def test_permission_lost_after_construction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path / "d", None)
    real_open = os.open

    def deny(path, flags, *a, **kw):  # type: ignore[no-untyped-def]
        if flags & os.O_CREAT and Path(path).name.startswith(".tmp-"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", deny)
    with pytest.raises(StorePermissionError, match="cannot write"):
        tier.put("k", small(1))
    monkeypatch.undo()
    assert tier.keys() == [] and list(tier.path.glob(".tmp-*")) == []
