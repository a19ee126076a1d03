"""Progress display for slow model steps (fetch, dequantize, save): a rich progress bar on
stderr, and transformers' own tqdm bars silenced or routed into it."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Iterator


class Steps:
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

    def __enter__(self) -> "Steps":
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
    def step(self, key: str, description: str, total: int | None = None) -> Iterator["Step"]:
        t0 = time.perf_counter()
        task = None
        if self._progress is not None:
            task = self._progress.add_task(description, total=total, detail="")
        s = Step(self._progress, task, total)
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


class Step:
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
def quiet_transformers(step: "Step | None" = None) -> Iterator[None]:
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
