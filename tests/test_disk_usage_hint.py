"""DiskTier's usage hint: a put that fits the budget does not list the directory, and the hint is
never low — a crash, another writer on the same directory or a lost hint file leaves it absent
(the next put lists the directory), so the budget holds whatever happened."""

from __future__ import annotations

from pathlib import Path

import torch

from contextdeque.stores import DiskTier, StoreEntry
from contextdeque.stores.disk import SUFFIX, USAGE_NAME, USAGE_RESCAN_PUTS


def entry(i: int, numel: int = 200) -> StoreEntry:
    return StoreEntry({"x": torch.full((numel,), float(i))}, {"i": str(i)})


def entry_bytes(tmp_path: Path) -> int:
    return sum(p.stat().st_size for p in tmp_path.iterdir() if p.name.endswith(SUFFIX))


def counting_scans(tier: DiskTier) -> list[int]:
    calls = [0]
    real = tier._scan

    def scan():
        calls[0] += 1
        return real()

    tier._scan = scan  # type: ignore[method-assign]
    return calls


def test_puts_under_budget_do_not_list_the_directory(tmp_path):
    tier = DiskTier(tmp_path, 10**9, fsync=False)
    scans = counting_scans(tier)
    n = 40
    for i in range(n):
        tier.put(f"k{i}", entry(i))
    assert scans[0] == 1, "only the first put lists the directory; the rest trust the hint"
    assert int((tmp_path / USAGE_NAME).read_text()) == entry_bytes(tmp_path)
    tier.put("k3", entry(3), overwrite=True)  # replacing an entry counts its old file out
    assert int((tmp_path / USAGE_NAME).read_text()) == entry_bytes(tmp_path)
    for i in range(n, n + USAGE_RESCAN_PUTS):
        tier.put(f"k{i}", entry(i))
    assert scans[0] == 2, "and a put lists it again every USAGE_RESCAN_PUTS puts"


def test_the_budget_holds_with_two_writers_and_lost_hints(tmp_path):
    one = tier_size = DiskTier(tmp_path, None, fsync=False)
    tier_size.put("probe", entry(0))
    size = entry_bytes(tmp_path)
    one.delete("probe")
    budget = 12 * size
    a = DiskTier(tmp_path, budget, fsync=False)
    b = DiskTier(tmp_path, budget, fsync=False)
    unbounded = DiskTier(tmp_path, None, fsync=False)  # writes without a budget: clears the hint
    for i in range(60):
        (a, b, unbounded)[i % 3].put(f"k{i}", entry(i))
        if i % 7 == 0:
            (tmp_path / USAGE_NAME).unlink(missing_ok=True)  # e.g. a crash between commit and hint
        if i % 3 != 2:
            assert entry_bytes(tmp_path) <= budget, i
        hint = tmp_path / USAGE_NAME
        if hint.exists():
            assert int(hint.read_text()) >= entry_bytes(tmp_path), "the hint is never low"
    a.put("last", entry(99))
    assert entry_bytes(tmp_path) <= budget


def test_deletes_and_a_torn_hint_are_safe(tmp_path):
    size_probe = DiskTier(tmp_path / "p", None, fsync=False)
    size_probe.put("probe", entry(0))
    size = entry_bytes(tmp_path / "p")
    tier = DiskTier(tmp_path / "d", 5 * size, fsync=False)
    for i in range(5):
        tier.put(f"k{i}", entry(i))
    assert tier.delete("k0") and not (tmp_path / "d" / USAGE_NAME).exists()
    tier.put("k5", entry(5))
    (tmp_path / "d" / USAGE_NAME).write_text("1")  # torn: no newline, read as absent
    for i in range(6, 12):
        tier.put(f"k{i}", entry(i))
        assert entry_bytes(tmp_path / "d") <= 5 * size
