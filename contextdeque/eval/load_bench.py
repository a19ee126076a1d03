"""Overlapped vs sequential tier loading (MPIC section 3.2).

A window of ``--chunks`` chunks of ``--chunk-tokens`` tokens of real text (``pydoc_data``) on the
default model, half of them stored on disk (every other chunk, encoded once beforehand and written
to a ``DiskTier`` as a demoted canonical would be), half never seen. Each run builds the window
with ``ContextWindow.extend`` on a fresh store (a fresh device tier over the same disk
directory): ``sequential`` loads and encodes one chunk after another; ``overlapped`` reads the
disk chunks on a background thread while the model encodes the missing ones and forms every
patch. Runs alternate the two modes; the medians, the speed-up and the time split are printed,
and the two windows are compared bit for bit.

With ``capsule=RHO`` (``--capsule RHO``) the disk tier is a ``CapsuleTier``: the stored chunks rest
compressed (KVCapsule, linear, mean retention ``RHO``) with a basis fitted on 16 chunks of other
documentation topics than the window's, and every load reconstructs; the record adds the bytes the
disk holds against the uncompressed entries and the chunks' relative reconstruction error.

The disk files sit in the OS page cache after the first read (nothing here can drop it), so a
load costs the read from the page cache, the entry checksum and the decode — what a warm local
disk costs; a cold disk or a remote tier makes loads slower and the overlap worth more.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import torch
from ..patch.rank import DEFAULT_RANK


def _disk(disk_dir: str, bank: Any) -> Any:
    from ..stores import CapsuleTier, DiskTier

    disk = DiskTier(disk_dir, None)
    return disk if bank is None else CapsuleTier(disk, bank)


def calibration_ids(backend: Any, n: int, size: int) -> list[list[int]]:
    """``n`` chunks of ``size`` token ids from the *last* documentation topics (the window's chunks
    come from the first ones, so a basis fitted on these never saw them)."""
    from pydoc_data.topics import topics

    from .window_bench import _chunks

    names = sorted(topics)[::-1]
    text = "\n\n".join(topics[k] for k in names)
    return _chunks(backend, n, size, text=text)


def measure(backend: Any, ids: list[list[int]], disk_dir: str, *, runs: int, policy: str, rank: int,
            workers: int, storage: str, bank: Any = None) -> dict[str, Any]:
    """Build the window ``runs`` times per mode (alternating) over the stored disk chunks
    (``bank``: a ``CapsuleBank``, the disk tier then keeps them compressed)."""
    from ..stores import MemoryTier, TieredStore
    from ..window import ContextWindow

    def build(overlap: bool) -> tuple[Any, Any]:
        store = TieredStore([MemoryTier(backend.device, None, name="device"), _disk(disk_dir, bank)])
        win = ContextWindow(backend, rank=rank, store=store, patch_policy=policy, storage=storage)
        receipt = win.extend([{"token_ids": x} for x in ids], overlap=overlap, workers=workers)
        return win, receipt

    rec: dict[str, list[Any]] = {"sequential": [], "overlapped": []}
    wins: dict[str, Any] = {}
    for r in range(runs):
        order = ("sequential", "overlapped") if r % 2 == 0 else ("overlapped", "sequential")
        for mode in order:
            t0 = time.perf_counter()
            win, receipt = build(mode == "overlapped")
            wall = time.perf_counter() - t0
            rec[mode].append((wall, receipt))
            wins[mode] = win
    a, b = wins["sequential"], wins["overlapped"]
    identical = len(a.refs) == len(b.refs) and all(
        torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
        for ra, rb in zip(a.refs, b.refs) for x, y in zip(a.kv(ra), b.kv(rb))
    )
    out: dict[str, Any] = {"identical": identical}
    for mode, rows in rec.items():
        walls = [w for w, _ in rows]
        loading = [rc.loading for _, rc in rows]
        out[mode] = {
            "wall_s": statistics.median(walls),
            "walls_s": walls,
            "load_s": statistics.median(x["load_s"] for x in loading),
            "compute_s": statistics.median(x["compute_s"] for x in loading),
            "wait_s": statistics.median(x["wait_s"] for x in loading),
            "forwards": rows[0][1].forwards,
            "encodes": rows[0][1].encodes,
            "patches_formed": rows[0][1].patches_formed,
            "by_tier": loading[0]["by_tier"],
            "fallbacks": loading[0]["fallbacks"],
        }
    seq, ovl = out["sequential"], out["overlapped"]
    out["speedup"] = seq["wall_s"] / ovl["wall_s"]
    # what perfect overlap could give: the longer of the two streams
    out["ideal_speedup"] = seq["wall_s"] / max(seq["wall_s"] - seq["load_s"], seq["load_s"], 1e-9)
    return out


CALIBRATION_CHUNKS = 16


def run_load_bench(backend: Any, *, n_chunks: int = 8, chunk_tokens: int = 256, runs: int = 3, policy: str = "default",
                   rank: int = DEFAULT_RANK, workers: int = 1, storage: str = "float32", disk_dir: str | None = None,
                   capsule: float | None = None) -> dict[str, Any]:
    """Store every other chunk on disk (compressed with mean retention ``capsule`` when given),
    then :func:`measure`; returns the measured record."""
    from ..core.capsule import CapsuleBank, CapsuleChunk, CalibrationStats, reconstruction_error
    from ..stores import StoreEntry
    from ..window.store import WindowStore
    from .window_bench import _chunks

    if n_chunks < 2:
        raise ValueError("n_chunks must be >= 2 (half on disk, half missing)")
    ids = _chunks(backend, n_chunks, chunk_tokens)
    bank = extra = None
    if capsule is not None:
        cal = CalibrationStats.from_chunks([backend.encode(token_ids=x, storage=storage)
                                            for x in calibration_ids(backend, CALIBRATION_CHUNKS, chunk_tokens)])
        bank = CapsuleBank(float(capsule), calibrate=lambda c: cal)
        extra = {"retention": float(capsule), "calibration_chunks": CALIBRATION_CHUNKS, "recon_error_k": [],
                 "recon_error_v": []}
    with tempfile.TemporaryDirectory(prefix="cdq-load-bench-") as tmp:
        where = disk_dir or tmp
        disk = _disk(where, bank)
        stored_bytes = entry_bytes = 0
        for x in ids[::2]:  # every other chunk sits on disk, as a demoted canonical would
            c = backend.encode(token_ids=x, storage=storage)
            tensors, meta = c.to_entry()
            entry = StoreEntry(tensors, meta)
            disk.put(WindowStore.chunk_key(c), entry)
            stored_bytes += c.nbytes
            entry_bytes += entry.nbytes
            if extra is not None:
                basis = bank.basis_for(c)
                ek, ev = reconstruction_error(c, basis.reconstruct(basis.compress(c)))
                extra["recon_error_k"].append(ek)
                extra["recon_error_v"].append(ev)
        if extra is not None:
            raw = [disk.inner.get(k) for k in disk.keys()]
            extra["stored_entry_bytes"] = sum(e.nbytes for e in raw)
            extra["uncompressed_entry_bytes"] = entry_bytes
            extra["bytes_saved_fraction"] = 1.0 - extra["stored_entry_bytes"] / entry_bytes
            extra["kv_bytes_saved_fraction"] = 1.0 - sum(
                CapsuleChunk.from_entry(dict(e.tensors), dict(e.meta)).nbytes for e in raw) / stored_bytes
            extra["basis_bytes"] = sum(b.nbytes for b in bank.bases())
        res = measure(backend, ids, where, runs=runs, policy=policy, rank=rank, workers=workers, storage=storage,
                      bank=bank)
    res.update({"model": backend.name, "chunks": n_chunks, "chunk_tokens": chunk_tokens, "on_disk": len(ids[::2]),
                "missing": len(ids) - len(ids[::2]), "disk_bytes": stored_bytes, "policy": policy, "rank": rank,
                "workers": workers, "threads": torch.get_num_threads(), "runs": runs, "storage": storage,
                "capsule": extra})
    return res
