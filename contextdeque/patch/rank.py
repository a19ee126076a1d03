"""Patch ranks: the one default rank m (``DEFAULT_RANK``), the one sentinel for "every direction"
and the one resolver every caller uses.

A patch of a chunk of T tokens whose K (or V) rows are F = H*d wide holds at most min(T, F)
directions (its "cap"). ``FULL`` (``"full"``, or ``None``) asks for the cap: the patch then
reconstructs Δ exactly.
"""

from __future__ import annotations

from ..core.errors import PatchError

FULL = "full"
DEFAULT_RANK = 32  # the patch rank m every entry point defaults to (the window, the server, the commands, the arms)


def is_full(rank: int | str | None) -> bool:
    """Whether ``rank`` is the full-rank sentinel (``"full"`` or ``None``)."""
    return rank is None or rank == FULL


def rank_cap(n_tokens: int, width: int) -> int:
    """The most directions a ``[n_tokens, width]`` Δ has: ``min(T, F)``."""
    return min(int(n_tokens), int(width))


def resolve_rank(rank: int | str | None, n_tokens: int, width: int, what: str = "K", *, clamp: bool = False) -> int:
    """The rank to form for a ``[n_tokens, width]`` Δ: the cap for :data:`FULL`; else ``rank``,
    which must be >= 0. A rank above the cap is refused (:class:`PatchError`), or with ``clamp``
    (a window's chunk shorter than its rank m) lowered to the cap."""
    cap = rank_cap(n_tokens, width)
    if is_full(rank):
        return cap
    r = int(rank)  # type: ignore[arg-type]
    if r < 0:
        raise PatchError(f"{what} rank must be >= 0, got {r}")
    if r > cap:
        if clamp:
            return cap
        raise PatchError(f"{what} rank {r} exceeds min(T={n_tokens}, F={width}) = {cap}")
    return r
