"""Typed errors. Every refusal in contextdeque raises one of these, never silent garbage."""

from __future__ import annotations


class ContextDequeError(Exception):
    """Base class of every error contextdeque raises on purpose."""


class ArgumentError(ContextDequeError, ValueError):
    """An argument of a public entry point has a value it cannot take (the message names the
    argument and what was expected)."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of a public entry point has the wrong Python type (the message names the
    argument and the expected type)."""


class NumericsError(ContextDequeError, ArithmeticError):
    """A tensor contextdeque formed or was about to apply holds a non-finite value (inf/NaN), or
    would overflow its storage dtype: refused before anything is stored or decoded."""


class UnsupportedLayoutError(ContextDequeError):
    """The model's KV/RoPE layout cannot be relocated exactly (the message says why).

    ``reason`` names the kind of refusal (see ``contextdeque.model.structure.REFUSAL_REASONS``):
    e.g. ``"learned-positions"``, ``"recurrent"``, ``"proof-failed"``; ``measured`` is the
    relocation error that decided it, where one was measured; ``evidence`` names the parts of the
    model the reason rests on (e.g. the position-embedding modules).
    """

    def __init__(
        self, message: str, *, reason: str = "unsupported", measured: float | None = None, evidence: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.measured = measured
        self.evidence = tuple(evidence)


class FingerprintMismatchError(ContextDequeError):
    """A chunk or patch was produced by a different model (or layout) than the one asked to use it."""


class StorageDtypeError(ContextDequeError, ValueError):
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


class StoreWriteError(StoreError, OSError):
    """Writing a store entry failed part-way (disk full, I/O error): nothing was committed under
    the key; ``errno`` is the operating system's."""


class CollisionError(StoreError):
    """Two different contents hashed to one key (the collision guard tripped)."""


class StoreCapacityError(StoreError):
    """An entry cannot fit in a store tier's byte budget (too large, or the rest is pinned)."""


class StoreUnavailableError(StoreError):
    """A remote store tier is away (unreachable, timed out, loading): nothing was written there;
    the caller falls back to its local tiers."""


class StoreConfigError(StoreError, ValueError):
    """A store tier is misconfigured (bad URL, option, or TLS settings); the message never holds a secret."""


class UnknownTierError(StoreConfigError, KeyError):
    """A store has no tier of that name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class StoreAuthError(StoreError, PermissionError):
    """A remote store refused the configured credentials (the message never holds them)."""


class InvalidEntryError(StoreError, ValueError):
    """A store entry is malformed (non-tensor values, non-str metadata, reserved metadata keys)."""


class WindowError(ContextDequeError, ValueError):
    """A window operation was asked something impossible (unknown ref, wrong reorder set, budget)."""


class WindowTypeError(WindowError, ArgumentTypeError):
    """A window argument has the wrong Python type (a ``WindowError`` and a ``TypeError``)."""


class UnknownRefError(WindowError, KeyError):
    """The chunk reference is unknown to this window, or was evicted and purged."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class BudgetError(WindowError):
    """The token budget cannot hold what was asked (e.g. smaller than one chunk)."""


class SessionError(WindowError):
    """A saved window session cannot be opened: not a session file, an unknown schema version,
    a corrupt file, or another model / layout / root than the backend it is opened with."""


class TraceError(ContextDequeError, ValueError):
    """A trace is malformed or inconsistent. ``path``, ``line`` (1-based; the header is line 1) and
    ``field`` say where; the message names them too."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None, field: str | None = None) -> None:
        where = ":".join(str(x) for x in (path, line) if x is not None)
        if field:
            where = f"{where} field {field!r}" if where else f"field {field!r}"
        super().__init__(f"{where}: {message}" if where else message)
        self.path, self.line, self.field = path, line, field


class TraceVersionError(TraceError):
    """The trace was written in a newer format version than this contextdeque reads."""


class UnknownChunkError(TraceError, KeyError):
    """A trace event names a chunk the trace never introduced (or that is not where it says)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class EnvelopeError(ContextDequeError, ValueError):
    """A model's fidelity envelope (energy -> η) that cannot be built or used."""


class PolicyError(ContextDequeError, ValueError):
    """An unknown or misconfigured replay policy (placement, eviction or reuse arm)."""


class ReuseArmError(ContextDequeError, ValueError):
    """A reuse arm was misconfigured (unknown name, bad budget or schedule) or given a request it cannot serve."""


class SelectionError(ContextDequeError, ValueError):
    """A KV selection was asked something impossible: a budget below one row per head, an unknown
    selector, a parameter out of range, or a model whose queries it cannot rebuild."""


class SelectionTypeError(SelectionError, TypeError):
    """A KV selection argument has the wrong type (e.g. a budget that is not an integer)."""


class CapsuleError(ContextDequeError, ValueError):
    """A compressed-at-rest chunk and a capsule basis do not fit (another chunk length, layer or
    head count), or a basis was asked something impossible (retention outside (0, 1])."""


class AgentInputError(ContextDequeError, ValueError):
    """An agent or adapter was handed input it cannot use (the message names the argument)."""


class MessageFormatError(AgentInputError):
    """A chat-messages list is malformed (unknown role, content of the wrong shape, a bad part)."""


class MessageTypeError(MessageFormatError, TypeError):
    """A chat-messages list (or one of its messages or parts) has the wrong Python type."""


class TemplateError(AgentInputError):
    """The tokenizer's chat template cannot be cut into per-message chunks (it does not render
    messages incrementally, or per-message tokens differ from the whole list's)."""


class MediaError(AgentInputError):
    """An image or video cannot be read or decoded."""


class MediaTypeError(MediaError, TypeError):
    """An image or video was handed over as a Python type contextdeque does not read."""


class UnsupportedMediaError(MediaError):
    """An image or video is readable but in a mode contextdeque does not take (e.g. CMYK, RGBA)."""


class FetchError(ContextDequeError, OSError):
    """A URL could not be fetched (unreachable host, refused connection, timeout, HTTP error)."""


class ContentTypeError(AgentInputError):
    """A fetched resource is not of the kind asked for (e.g. a web agent got CSS, not HTML)."""
