"""On-disk entry format: one safetensors file, metadata and checksums in its header.

Reserved header metadata (besides the entry's own ``str -> str`` metadata):
- ``cdq.format``: format version (``"1"``);
- ``cdq.key``: the full store key (file names are hashes of it);
- ``cdq.priority``: eviction priority (int as str);
- ``cdq.meta_sha256``: sha256 over every metadata item and every tensor's name, dtype
  and shape, so a header can be verified without reading the tensors;
- ``cdq.data_sha256``: sha256 over the tensors' bytes (sorted by name).

Decoding never trusts a file: any deviation raises `CorruptEntryError`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import safetensors.torch
import torch

from contextdeque.core.errors import CorruptEntryError, InvalidEntryError
from contextdeque.stores.base import RESERVED_META_PREFIX, StoreEntry

FORMAT_VERSION = "1"
K_FORMAT = "cdq.format"
K_KEY = "cdq.key"
K_PRIORITY = "cdq.priority"
K_META_SUM = "cdq.meta_sha256"
K_DATA_SUM = "cdq.data_sha256"
_SUMS = (K_META_SUM, K_DATA_SUM)

# A safetensors header is JSON of names, dtypes, shapes and metadata; anything this large
# is not one of ours (and must not make us allocate gigabytes on a corrupt length field).
MAX_HEADER_BYTES = 64 * 1024 * 1024


def _lp(h: hashlib._Hash, b: bytes) -> None:  # type: ignore[name-defined]
    """Length-prefixed update: keeps the hashed encoding injective."""
    h.update(len(b).to_bytes(8, "little"))
    h.update(b)


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in memory order (any dtype, 0-d and empty included)."""
    flat = t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def meta_sha256(meta: Mapping[str, str], descr: Mapping[str, tuple[str, tuple[int, ...]]]) -> str:
    """sha256 over metadata (minus the two sums) and tensor descriptors (name -> (dtype, shape))."""
    h = hashlib.sha256(b"cdq-store-meta-v1\0")
    items = sorted((k, v) for k, v in meta.items() if k not in _SUMS)
    h.update(len(items).to_bytes(8, "little"))
    for k, v in items:
        _lp(h, k.encode("utf-8", "surrogatepass"))
        _lp(h, v.encode("utf-8", "surrogatepass"))
    h.update(len(descr).to_bytes(8, "little"))
    for name in sorted(descr):
        dtype, shape = descr[name]
        _lp(h, name.encode("utf-8", "surrogatepass"))
        _lp(h, dtype.encode())
        _lp(h, ",".join(str(s) for s in shape).encode())
    return h.hexdigest()


def data_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the tensors' raw bytes, sorted by name (length-prefixed)."""
    h = hashlib.sha256(b"cdq-store-data-v1\0")
    h.update(len(tensors).to_bytes(8, "little"))
    for name in sorted(tensors):
        _lp(h, name.encode("utf-8", "surrogatepass"))
        _lp(h, _raw_bytes(tensors[name]))
    return h.hexdigest()


# safetensors dtype tags -> torch dtype names (for descriptors read from a header). Taken
# from safetensors itself when it exposes its table, so both sides always agree.
_FALLBACK_TAGS = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_ST_DTYPES: dict[str, str] = {
    tag: str(dt).removeprefix("torch.")
    for tag, dt in (getattr(safetensors.torch, "_TYPES", None) or _FALLBACK_TAGS).items()
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cpu_unshared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors owning their storage (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        c = t.detach().to("cpu").contiguous()
        st = c.untyped_storage()
        ptr = st.data_ptr()
        if c.numel() and (ptr in seen or st.nbytes() != c.numel() * c.element_size()):
            c = c.clone()
            ptr = c.untyped_storage().data_ptr()
        if c.numel():
            seen.add(ptr)
        out[name] = c
    return out


def encode_entry(key: str, entry: StoreEntry, priority: int) -> bytes:
    """Serialize ``entry`` under ``key`` into safetensors bytes with checksums in the header."""
    entry.user_meta_check()
    tensors = _cpu_unshared(entry.tensors)
    meta = dict(entry.meta)
    meta[K_FORMAT] = FORMAT_VERSION
    meta[K_KEY] = key
    meta[K_PRIORITY] = str(int(priority))
    descr = {n: (_dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()}
    meta[K_META_SUM] = meta_sha256(meta, descr)
    meta[K_DATA_SUM] = data_sha256(tensors)
    try:
        return safetensors.torch.save(tensors, metadata=meta)
    except Exception as e:  # safetensors raises plain exceptions for unsupported dtypes
        raise InvalidEntryError(f"entry {key!r} cannot be serialized with safetensors: {e}") from e


@dataclass(frozen=True)
class Header:
    """A verified header: the key, the user metadata, priority and payload size."""

    key: str
    meta: dict[str, str]
    priority: int
    payload_nbytes: int


def _corrupt(origin: str, why: str) -> CorruptEntryError:
    return CorruptEntryError(f"corrupt store entry {origin}: {why}")


def parse_header(head: bytes, file_size: int, origin: str) -> tuple[int, Header]:
    """Verify a safetensors header (``head`` = the file's first bytes, at least 8 + its length).

    Returns ``(header_len, Header)``. ``file_size`` is the size of the whole file.

    Raises:
        CorruptEntryError: truncated, malformed, or failing ``cdq.meta_sha256``.
    """
    if file_size < 8 or len(head) < 8:
        raise _corrupt(origin, f"file of {file_size} bytes is too short for a safetensors header")
    n = int.from_bytes(head[:8], "little")
    if n < 2 or n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise _corrupt(origin, f"header length {n} does not fit a file of {file_size} bytes (truncated?)")
    if len(head) < 8 + n:
        raise _corrupt(origin, "truncated header")
    try:
        hdr = json.loads(head[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _corrupt(origin, f"malformed header JSON ({e})") from None
    if not isinstance(hdr, dict):
        raise _corrupt(origin, "header is not a JSON object")
    meta = hdr.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _corrupt(origin, "header metadata missing or not str -> str")
    if meta.get(K_FORMAT) != FORMAT_VERSION:
        raise _corrupt(origin, f"not a contextdeque store entry (format {meta.get(K_FORMAT)!r})")
    descr: dict[str, tuple[str, tuple[int, ...]]] = {}
    end = 0
    for name, info in hdr.items():
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, stop = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise _corrupt(origin, f"bad tensor descriptor for {name!r} ({e!r})") from None
        descr[name] = (dtype, shape)
        end = max(end, stop, begin)
    if meta_sha256(meta, descr) != meta.get(K_META_SUM):
        raise _corrupt(origin, "header checksum mismatch")
    if 8 + n + end != file_size:
        raise _corrupt(origin, f"data section is {file_size - 8 - n} bytes, header describes {end} (truncated?)")
    try:
        priority = int(meta[K_PRIORITY])
        key = meta[K_KEY]
    except (KeyError, ValueError):
        raise _corrupt(origin, "reserved metadata missing") from None
    user = {k: v for k, v in meta.items() if not k.startswith(RESERVED_META_PREFIX)}
    return n, Header(key=key, meta=user, priority=priority, payload_nbytes=end)


def decode_entry(
    key: str, data: bytes, origin: str, check: Callable[[Header], None] | None = None, *, verify_data: bool = True
) -> tuple[StoreEntry, Header]:
    """Decode and fully verify one entry file's bytes, which must be stored under ``key``.

    ``check`` runs on the verified header before any tensor is materialized (e.g. to refuse
    another model's entry without loading it); whatever it raises propagates.
    ``verify_data=False`` skips the tensor-data checksum, for callers that already verified
    a stronger digest of all of ``data`` (the header is verified regardless).

    Raises:
        CorruptEntryError: anything off (truncation, malformed header, checksum, wrong key).
    """
    _, header = parse_header(data, len(data), origin)
    if header.key != key:
        raise _corrupt(origin, f"file holds key {header.key!r}, expected {key!r}")
    if check is not None:
        check(header)
    try:
        tensors = safetensors.torch.load(data)
    except Exception as e:  # SafetensorError and friends: the bytes are not valid safetensors
        raise _corrupt(origin, f"safetensors refused the file ({e})") from None
    meta_all = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")].decode())["__metadata__"]
    if verify_data and data_sha256(tensors) != meta_all[K_DATA_SUM]:
        raise _corrupt(origin, "tensor data checksum mismatch")
    return StoreEntry(tensors=tensors, meta=header.meta), header
