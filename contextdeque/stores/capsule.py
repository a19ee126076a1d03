"""`CapsuleTier`: a tier that keeps chunk canonicals compressed at rest (KVCapsule, linear variant).

It wraps any other tier (host memory, disk, a remote tier) and a
:class:`~contextdeque.core.capsule.CapsuleBank`. A chunk entry put into it is compressed with
the bank's basis for the chunk's shape (model, layout, length, modality) and the *capsule* is
what the inner tier stores and budgets; a read reconstructs the chunk (content frame) and answers
with an ordinary chunk entry, so every path that reads a tier — ``TieredStore.get`` and its
promotion, demotion, spills, a ``Prefetcher`` — sees chunks and never a capsule. Relocation,
patches and the window work on the reconstruction as on any canonical.

What it does not compress, it stores as it is: patches, encoder embeddings, and chunks of a
shape the bank has no basis for (a bank made with ``calibrate=`` fits one on first use).
``basis_dir``: bases are saved there (safetensors, checksummed, with the model fingerprint) the
first time they compress a chunk, and a capsule whose basis the bank lacks is looked up there —
so a persistent inner tier stays readable by the next process. A capsule whose basis is nowhere
is a ``CapsuleError``; a malformed capsule entry a ``CorruptEntryError`` (``corrupt_ok``: dropped,
read as a miss), as for any bad copy.

Budget and ``nbytes`` are the inner tier's, so they count compressed bytes; ``TierTraffic``
counts the entries as handed in and out (uncompressed).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from contextdeque.core.capsule import CapsuleBank, CapsuleBasis, CapsuleChunk
from contextdeque.core.chunk import Chunk
from contextdeque.core.errors import CapsuleError, CorruptEntryError
from contextdeque.stores.base import Evicted, Expect, PutRequest, PutResult, StoreEntry, Tier, check_expectations
from contextdeque.stores.registry import make_tier


class CapsuleTier(Tier):
    """Chunks compressed at rest in ``inner`` (a `Tier`, or a registered tier kind built with
    ``**inner_kwargs``), with the bases of ``bank``. ``name``: default the inner tier's."""

    kind = "capsule"

    def __init__(
        self,
        inner: Tier | str,
        bank: CapsuleBank,
        *,
        basis_dir: str | Path | None = None,
        name: str | None = None,
        **inner_kwargs: Any,
    ) -> None:
        if isinstance(inner, str):
            inner = make_tier(inner, **inner_kwargs)
        elif inner_kwargs:
            raise TypeError(f"tier arguments {sorted(inner_kwargs)} are for a tier kind, not a built tier")
        if not isinstance(inner, Tier):
            raise TypeError(f"inner must be a Tier or a registered tier kind, got {type(inner).__name__}")
        if isinstance(inner, CapsuleTier):
            raise TypeError("a CapsuleTier cannot wrap another CapsuleTier")
        if not isinstance(bank, CapsuleBank):
            raise TypeError(f"bank must be a CapsuleBank, got {type(bank).__name__}")
        super().__init__(name=name or inner.name, budget_bytes=inner.budget_bytes, policy=inner.policy)
        self.inner = inner
        self.bank = bank
        self.basis_dir = None if basis_dir is None else Path(basis_dir)
        self.persistent = inner.persistent
        self.remote = inner.remote
        self.shared = inner.shared
        self._saved: set[str] = set()
        self._bank_lock = threading.Lock()

    @property
    def budget_bytes(self) -> int | None:
        return self.inner.budget_bytes

    # ------------------------------------------------------------------ codec
    def _basis_path(self, basis_id: str) -> Path:
        assert self.basis_dir is not None
        return self.basis_dir / f"{basis_id}.safetensors"

    def encode(self, entry: StoreEntry) -> StoreEntry:
        """A chunk entry -> its capsule entry (anything else, or a chunk without a basis: as is)."""
        if entry.kind != "chunk":
            return entry
        chunk = Chunk.from_entry(dict(entry.tensors), dict(entry.meta))
        # a reconstruction compresses again to its own capsule (kept rows are kept exactly, and
        # the value basis is orthogonal to the token mean), up to rounding
        with self._bank_lock:
            basis = self.bank.find(chunk)
        if basis is None:
            return entry
        if self.basis_dir is not None and basis.id not in self._saved:
            path = self._basis_path(basis.id)
            if not path.exists():
                basis.save(path)
            self._saved.add(basis.id)
        tensors, meta = basis.compress(chunk).to_entry()
        return StoreEntry(tensors, meta)

    def _basis(self, basis_id: str) -> CapsuleBasis:
        with self._bank_lock:
            basis = self.bank.by_id(basis_id)
            if basis is None and self.basis_dir is not None and self._basis_path(basis_id).exists():
                basis = CapsuleBasis.load(self._basis_path(basis_id))
                if basis.id != basis_id:
                    raise CorruptEntryError(f"capsule basis file {self._basis_path(basis_id)} holds basis {basis.id[:12]}")
                self.bank.add(basis)
                self._saved.add(basis_id)
        if basis is None:
            raise CapsuleError(f"no capsule basis {basis_id[:12]} in this tier's bank"
                               + ("" if self.basis_dir is None else f" or in {self.basis_dir}"))
        return basis

    def decode(self, entry: StoreEntry) -> StoreEntry:
        """A capsule entry -> the reconstructed chunk's entry (anything else: as is)."""
        if entry.kind != "capsule":
            return entry
        cap = CapsuleChunk.from_entry(dict(entry.tensors), dict(entry.meta))
        tensors, meta = self._basis(cap.basis_id).reconstruct(cap).to_entry()
        return StoreEntry(tensors, meta)

    # ------------------------------------------------------------------ Tier
    def _read(self, key: str, expect: Expect, corrupt_ok: bool) -> StoreEntry | None:
        raw = self.inner.get(key, expect_fingerprint=expect.fingerprint, expect_layout=expect.layout,
                             corrupt_ok=corrupt_ok)
        if raw is None:
            return None
        try:
            out = self.decode(raw)
        except CorruptEntryError:
            if not corrupt_ok:
                raise
            self.inner.delete(key)
            return None
        # the digest is the chunk's, not the capsule's: checked on the reconstruction
        check_expectations(key, out.meta, expect_digest=expect.digest)
        return out

    def peek(self, key: str) -> Mapping[str, str] | None:
        meta = self.inner.peek(key)
        if meta is None or meta.get("kind") != "capsule":
            return meta
        return CapsuleChunk.chunk_entry_meta(meta)

    def _write(self, key: str, entry: StoreEntry, request: PutRequest) -> PutResult:
        res = self.inner.put(key, self.encode(entry), **vars(request))
        if not any(ev.entry is not None and ev.entry.kind == "capsule" for ev in res.evicted):
            return res
        # victims spill into the tiers below as chunks, like from any other tier
        evicted = tuple(ev if ev.entry is None else Evicted(ev.key, ev.nbytes, ev.priority, self.decode(ev.entry))
                        for ev in res.evicted)
        return PutResult(res.stored, evicted)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def keys(self) -> list[str]:
        return self.inner.keys()

    def nbytes(self) -> int:
        return self.inner.nbytes()

    def priority_of(self, key: str) -> int:
        return self.inner.priority_of(key)

    def pin(self, key: str) -> bool:
        return self.inner.pin(key)

    def unpin(self, key: str) -> bool:
        return self.inner.unpin(key)

    def is_pinned(self, key: str) -> bool:
        return self.inner.is_pinned(key)

    # leases are the inner tier's (it renews them)
    def _take_leases(self, keys: list[str]) -> None:
        self.inner.lease(keys)

    def _drop_leases(self, keys: list[str]) -> None:
        self.inner.unlease(keys)

    def close(self) -> None:
        super().close()
        self.inner.close()

    def __repr__(self) -> str:
        return f"CapsuleTier({self.inner!r}, bases={len(self.bank)}, basis_dir={self.basis_dir})"
