"""Patch signatures and the parts of a patch's store key: what decides a patch's meaning, in one place.

A patch's *antecedent signature* names the context it was formed on: the antecedent chunk ids
(in order, or as a set for kinds where order does not count), what the kind adds (a stacked kind:
the ids of the patches it is stacked on, see ``PatchKind.signature_extra``), and, in a store key,
the caller's formation context (e.g. a window's policy regime and adaptive-rank target). The patch
records the signature it was formed with (hence its id); a store key uses :func:`patch_key_parts`.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Sequence

from ..core.errors import PatchError

PATCH_KEY_VERSION = 3
"""Scheme of patch signatures and patch store keys. Part of every patch key: an entry written
under another scheme is never looked up (a miss, re-formed), never served under the new meaning.
Version 1 (before this module) had two signature functions and no version part in the key;
version 2 named the antecedents by chunk id only, so a patch formed on healed antecedents was
valid by key behind the same chunks unhealed; version 3 names their KV states (:func:`kv_state`)."""


def antecedent_signature(ids: Iterable[str], *, ordered: bool = True, extra: Iterable[str] = ()) -> str:
    """A stable 64-hex sha256 of antecedent chunk ids (a sequence if ``ordered``, else a set) and
    ``extra`` parts (in the order given). Length-prefixed: ``["ab"]`` and ``["a", "b"]`` differ,
    as do ids and extra parts with the same strings."""
    ids = list(ids) if ordered else sorted(ids)
    extra = list(extra)
    h = hashlib.sha256(f"cdq-antecedents-v{PATCH_KEY_VERSION}\0".encode() + (b"o" if ordered else b"s"))
    for part in (ids, extra):
        h.update(len(part).to_bytes(8, "little"))
        for s in part:
            if not isinstance(s, str):
                raise PatchError(f"signature parts must be str, got {type(s).__name__}")
            b = s.encode("utf-8", "surrogatepass")
            h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()


def kv_state(chunk_id: str, conditioning: Iterable[str] = ()) -> str:
    """A content-addressed name of one chunk's KV *state*: its chunk id and what conditions it, in
    order (the store keys of the patches it carries, which name their own antecedents' states,
    so the name is recursive; or, for KV from a conditioned forward, the states it ran after).
    The canonical's state is ``kv_state(chunk_id)``. Window-independent: two windows that built
    the same content the same way name it alike (they share patches)."""
    return antecedent_signature([chunk_id], extra=["kv-state", *conditioning])[:32]


def patch_signature(kind: str, antecedent_ids: Sequence[str], base_ids: Sequence[str] = (),
                    context: Sequence[str] = ()) -> str:
    """The signature of a ``kind`` patch on ``antecedent_ids``: ordered as the kind says, plus the
    kind's own parts for the patches it is stacked on (``base_ids``), plus ``context`` (what the
    caller's formation depends on besides, e.g. ``"regime:quality"``)."""
    from .base import PATCH_KINDS  # base imports this module for its signatures

    if kind not in PATCH_KINDS:
        raise PatchError(f"unknown patch kind {kind!r}; known: {sorted(PATCH_KINDS)}")
    impl = PATCH_KINDS[kind]
    return antecedent_signature(antecedent_ids, ordered=impl.ordered, extra=[*impl.signature_extra(base_ids), *context])


def rank_tag(ranks: int | Sequence[int]) -> str:
    """``"16"`` for rank 16, ``"16-32"`` for (rank_k, rank_v) = (16, 32).

    Raises:
        PatchError: not a non-negative int or a non-empty sequence of them."""
    rs = tuple(ranks) if isinstance(ranks, (tuple, list)) else (ranks,)
    if not rs or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in rs):
        raise PatchError(f"patch rank must be a non-negative int or a sequence of them, got {ranks!r}")
    return "-".join(str(r) for r in rs)


def patch_key_parts(chunk_key: str, signature: str, kind: str, ranks: int | Sequence[int]) -> tuple[str, ...]:
    """The parts of a patch's store key, in order: scheme version, the patched chunk's key, the
    signature, the stored kind (``PatchKind.store_kind``: kinds measuring the same thing share
    one), the rank tag. The window joins them under the store's ``"patch"`` namespace."""
    return (f"v{PATCH_KEY_VERSION}", chunk_key, signature, kind, "r" + rank_tag(ranks))
