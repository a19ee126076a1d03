"""Argument checks for public entry points: a user mistake becomes an ``ArgumentTypeError``
(a ``TypeError``) or an ``ArgumentError``-family error (a ``ValueError``) naming the argument,
raised before any work is done."""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import torch

from .errors import ArgumentError, ArgumentTypeError


def type_name(value: Any) -> str:
    return type(value).__name__


def check_int(
    name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
    none_ok: bool = False, error: type[ArgumentError] = ArgumentError,
) -> int | None:
    """``value`` as an int in ``[minimum, maximum]`` (bools and floats are refused)."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() and value.dtype != torch.bool:
            value = int(value.item())
        else:
            raise ArgumentTypeError(f"{name} must be an int{' or None' if none_ok else ''}, got {type_name(value)} {_short(value)}")
    if minimum is not None and value < minimum:
        raise error(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise error(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def check_float(
    name: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
    none_ok: bool = False, open_min: bool = False, error: type[ArgumentError] = ArgumentError,
) -> float | None:
    """``value`` as a finite float in range (bools refused; ``open_min``: strictly above ``minimum``)."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a number{' or None' if none_ok else ''}, got {type_name(value)} {_short(value)}")
    v = float(value)
    if not math.isfinite(v):
        raise error(f"{name} must be finite, got {v}")
    if minimum is not None and (v < minimum or (open_min and v == minimum)):
        raise error(f"{name} must be {'>' if open_min else '>='} {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise error(f"{name} must be <= {maximum}, got {v}")
    return v


def check_str(name: str, value: Any, *, none_ok: bool = False, choices: Sequence[str] | None = None,
              error: type[ArgumentError] = ArgumentError) -> str | None:
    if value is None and none_ok:
        return None
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be a str{' or None' if none_ok else ''}, got {type_name(value)} {_short(value)}")
    if choices is not None and value not in choices:
        raise error(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return value


def check_instance(name: str, value: Any, types: type | tuple[type, ...], what: str, *, none_ok: bool = False) -> Any:
    if value is None and none_ok:
        return None
    if not isinstance(value, types):
        raise ArgumentTypeError(f"{name} must be {what}{' or None' if none_ok else ''}, got {type_name(value)} {_short(value)}")
    return value


def check_token_ids(
    name: str, value: Any, vocab_size: int | None, *, error: type[ArgumentError] = ArgumentError,
    empty_error: type[Exception] | None = None,
) -> torch.Tensor:
    """``value`` (a sequence of ints or an integer tensor) as a 1-D int64 CPU tensor of ids in
    ``[0, vocab_size)``: floats, strings, nested lists, 2-D tensors and empty input are refused."""
    if not isinstance(value, torch.Tensor) and hasattr(value, "__array__") and hasattr(value, "dtype"):
        value = torch.as_tensor(value)  # a numpy array
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ArgumentTypeError(f"{name} must hold integer token ids, got a {value.dtype} tensor")
        if value.dim() != 1:
            raise error(f"{name} must be 1-D [T], got a tensor of shape {tuple(value.shape)}")
        ids = value.detach().to("cpu", torch.long)
    elif isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentTypeError(f"{name} must be a sequence of ints or a 1-D integer tensor, got {type_name(value)} {_short(value)}")
    else:
        for i, x in enumerate(value):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise ArgumentTypeError(f"{name}[{i}] must be an int token id, got {type_name(x)} {_short(x)}")
        ids = torch.tensor([int(x) for x in value], dtype=torch.long) if len(value) else torch.zeros(0, dtype=torch.long)
    if ids.numel() == 0:
        raise (empty_error or error)(f"{name} is empty: a chunk needs at least one token")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        bad = lo if lo < 0 else hi
        raise error(f"{name} holds token id {bad}, outside the model's vocabulary [0, {vocab_size})")
    return ids


def _short(value: Any) -> str:
    r = repr(value) if not isinstance(value, torch.Tensor) else f"tensor{tuple(value.shape)}"
    return r if len(r) <= 40 else r[:37] + "..."
