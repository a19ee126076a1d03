"""Typed errors. Every refusal in contextdeque raises one of these, never silent garbage."""

from __future__ import annotations


class ContextDequeError(Exception):
    """Base class of every error contextdeque raises on purpose."""


class UnsupportedLayoutError(ContextDequeError):
    """The model's KV/RoPE layout cannot be relocated exactly (the message says why)."""


class FingerprintMismatchError(ContextDequeError):
    """A chunk or patch was produced by a different model (or layout) than the one asked to use it."""


class StorageDtypeError(ContextDequeError):
    """The requested storage dtype cannot hold this layout's KV faithfully."""


class PositionError(ContextDequeError, ValueError):
    """A placement position is negative, overflows the position dtype, or breaks the RoPE regime."""


class EmptyChunkError(ContextDequeError, ValueError):
    """A chunk must hold at least one token."""


class ModelLoadError(ContextDequeError):
    """The model (or the embedded default model) could not be obtained or loaded."""


class PatchError(ContextDequeError, ValueError):
    """A patch does not fit the chunk/model/antecedents it is applied to, or cannot be formed."""


class KernelArgumentError(ContextDequeError, ValueError):
    """Tensors handed to a kernel disagree (shapes, devices, strides, rotary slice, destination)."""


class StoreError(ContextDequeError):
    """Base class of store failures."""


class CorruptEntryError(StoreError):
    """A stored file failed verification (checksum, truncation, malformed header)."""


class StorePermissionError(StoreError, PermissionError):
    """The store directory cannot be read or written."""


class CollisionError(StoreError):
    """Two different contents hashed to one key (the collision guard tripped)."""


class StoreCapacityError(StoreError):
    """An entry cannot fit in a store tier's byte budget (too large, or the rest is pinned)."""


class InvalidEntryError(StoreError, ValueError):
    """A store entry is malformed (non-tensor values, non-str metadata, reserved metadata keys)."""


class WindowError(ContextDequeError, ValueError):
    """A window operation was asked something impossible (unknown ref, wrong reorder set, budget)."""


class UnknownRefError(WindowError, KeyError):
    """The chunk reference is unknown to this window, or was evicted and purged."""


class BudgetError(WindowError):
    """The token budget cannot hold what was asked (e.g. smaller than one chunk)."""


class TraceError(ContextDequeError, ValueError):
    """A trace line is malformed (the message gives the line number)."""


class ReuseArmError(ContextDequeError, ValueError):
    """A reuse arm was misconfigured (unknown name, bad budget or schedule) or given a request it cannot serve."""
