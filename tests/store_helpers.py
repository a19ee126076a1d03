"""Entries, tiers and a three-tier store the store tests (``test_stores*.py``) share."""

from __future__ import annotations

from pathlib import Path

import torch

from contextdeque.stores import (
    DiskTier,
    HostTier,
    MemoryTier,
    StoreEntry,
    TieredStore,
)

STORES_DIR = Path(__file__).resolve().parents[1] / "contextdeque" / "stores"


def make_entry(version: int, nbytes: int, fingerprint: str = "fp-A") -> StoreEntry:
    """Deterministic entry of about ``nbytes`` payload bytes; content is a function of version."""
    g = torch.Generator().manual_seed(version)
    n = max(nbytes // 4 - 64, 1)
    x = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int32)
    y = torch.randn(4, 16, generator=g).to(torch.bfloat16)
    meta = {
        "fingerprint": fingerprint,
        "layout": "gqa:h4:d16",
        "kind": "chunk",
        "version": str(version),
        "content_digest": f"digest-{version:08d}",
    }
    return StoreEntry({"x": x, "y": y}, meta)


def same(a: StoreEntry, b: StoreEntry) -> bool:
    if dict(a.meta) != dict(b.meta) or set(a.tensors) != set(b.tensors):
        return False
    return all(
        a.tensors[n].dtype == b.tensors[n].dtype
        and a.tensors[n].shape == b.tensors[n].shape
        and torch.equal(a.tensors[n].cpu(), b.tensors[n].cpu())
        for n in a.tensors
    )


def small(i: int, numel: int = 25, **meta: str) -> StoreEntry:
    """A 4*numel-byte entry; keys/values of equal length so disk files have equal sizes."""
    m = {"fingerprint": "fp-A", "layout": "L1", "kind": "chunk", "content_digest": f"d{i:04d}"}
    m.update(meta)
    return StoreEntry({"x": torch.full((numel,), float(i))}, m)


def disk_file_size(tmp_path: Path, entry: StoreEntry, key: str = "k0000") -> int:
    probe = DiskTier(tmp_path / "probe", None)
    probe.put(key, entry)
    return probe.nbytes()


TIER_KINDS = ["memory", "host", "disk"]


def new_tier(kind: str, tmp_path: Path, budget: int | None, policy: str = "lru", name: str | None = None):
    if kind == "memory":
        return MemoryTier("cpu", budget, policy=policy, name=name or "device")
    if kind == "host":
        return HostTier(budget, policy=policy, name=name or "host")
    return DiskTier(tmp_path / (name or "disk"), budget, policy=policy, name=name or "disk")


def unit_budget(kind: str, tmp_path: Path, n_entries: float) -> int:
    """Budget that holds ``n_entries`` `small` entries in this tier's units."""
    unit = disk_file_size(tmp_path, small(0)) if kind == "disk" else small(0).nbytes
    return int(unit * n_entries)


def three_tiers(tmp_path: Path, dev: float = 2.5, host: float = 3.5, disk: int | None = None, **kw) -> TieredStore:
    return TieredStore(
        [
            MemoryTier("cpu", int(100 * dev), name="device"),
            HostTier(int(100 * host)),
            DiskTier(tmp_path / "disk", disk),
        ],
        **kw,
    )
