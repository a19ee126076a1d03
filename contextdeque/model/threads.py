"""How many CPU threads torch runs a model with: the one home of that choice.

torch's own default is one thread per physical core of the machine, whatever the process may
use and whatever else runs there. On a shared machine that oversubscribes the cores: on a busy
2-core machine the embedded 135M model ran its appends, healing and decoding 3-4x slower with
torch's default (2) than with one thread (issue 26; the measured table is in ``docs/serve.md``).

:func:`choose_threads` decides from, in order:

1. an explicit count (``load_model(threads=N)``, every command's ``--threads N``);
2. ``$CONTEXTDEQUE_THREADS`` (a count, or ``auto``);
3. ``$OMP_NUM_THREADS`` when set: torch already honours it, so it is left alone;
4. the machine: the cores the process may run on (CPU affinity and the cgroup's CPU quota),
   less the cores the load average says are busy, capped by the model's size (a small model's
   matrices are too small to split across many cores).

``0`` (or ``torch``) anywhere means "leave torch's own setting". The automatic choice is made
once per process, at its first model load; an explicit count always applies (so a command's
``--threads 2`` is not undone by a model loaded later with the default).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ArgumentError

THREADS_ENV = "CONTEXTDEQUE_THREADS"

PARAMS_PER_THREAD = 64_000_000
"""The model-size cap: one thread per this many parameters (at least one; SmolLM2-135M: 2).
Below it a layer's matrices at agent-sized spans are too small for another thread to pay for
its synchronisation."""

_CGROUP_V2_MAX = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
_CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


@dataclass(frozen=True)
class ThreadChoice:
    """A thread count and why: ``threads`` (None: torch's own setting is kept) and ``reason``
    (one line for logs and benchmark headers)."""

    threads: int | None
    reason: str


def available_cores() -> int:
    """Cores this process may use: its CPU affinity, further limited by a cgroup CPU quota
    (containers), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return max(1, cores)


def _cgroup_quota() -> float | None:
    """The cgroup's CPU quota in cores (v2 ``cpu.max`` or v1 ``cfs_quota_us``), None if unlimited."""
    try:
        if _CGROUP_V2_MAX.is_file():
            quota, period = _CGROUP_V2_MAX.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if _CGROUP_V1_QUOTA.is_file():
            quota_us = int(_CGROUP_V1_QUOTA.read_text())
            return None if quota_us <= 0 else quota_us / int(_CGROUP_V1_PERIOD.read_text())
    except (OSError, ValueError):
        return None
    return None


def parse_threads(value: "int | str | None", source: str) -> int | None:
    """``value`` as a thread count: None or ``auto`` -> None (choose), ``0`` / ``torch`` -> 0
    (torch's own), a positive int -> itself; anything else raises ``ArgumentError`` naming ``source``."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "auto"):
            return None
        if text == "torch":
            return 0
        try:
            value = int(text)
        except ValueError:
            raise ArgumentError(f"{source} must be a thread count, 'auto' or 'torch', got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ArgumentError(f"{source} must be a thread count >= 0 (0: torch's own), got {value!r}")
    return value


def choose_threads(threads: "int | str | None" = None, *, model_params: int | None = None,
                   cores: int | None = None, load: float | None = None) -> ThreadChoice:
    """The thread count to run a model of ``model_params`` parameters with (see the module
    docstring for the order of the sources). ``cores`` / ``load`` default to this machine's
    (:func:`available_cores`, the 1-minute load average)."""
    explicit = parse_threads(threads, "threads")
    if explicit is None:
        explicit = parse_threads(os.environ.get(THREADS_ENV), f"${THREADS_ENV}")
        source = f"${THREADS_ENV}"
    else:
        source = "asked"
    if explicit == 0:
        return ThreadChoice(None, f"torch's own setting ({source})")
    if explicit is not None:
        return ThreadChoice(explicit, source)
    if os.environ.get("OMP_NUM_THREADS"):
        return ThreadChoice(None, "$OMP_NUM_THREADS (torch honours it)")
    cores = available_cores() if cores is None else cores
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
    idle = max(1, min(cores, math.floor(cores - load + 0.5)))
    size_cap = max(1, model_params // PARAMS_PER_THREAD) if model_params else cores
    chosen = max(1, min(idle, size_cap))
    return ThreadChoice(chosen, f"auto: {cores} cores available, load {load:.1f}, "
                                f"{'model cap ' + str(size_cap) if model_params else 'no model size'}")


def parameter_count(model: object) -> int:
    """Parameters of a torch module (0 for anything else)."""
    parameters = getattr(model, "parameters", None)
    return sum(p.numel() for p in parameters()) if callable(parameters) else 0


_settled: ThreadChoice | None = None  # the choice this process runs with, once one was applied


def apply_threads(threads: "int | str | None" = None, *, model_params: int | None = None) -> ThreadChoice:
    """Choose (:func:`choose_threads`) and set torch's intra-op thread count; returns the choice
    (the one already settled, when this call would only choose automatically again)."""
    import torch

    global _settled
    if _settled is not None and parse_threads(threads, "threads") is None and not os.environ.get(THREADS_ENV):
        return _settled
    choice = choose_threads(threads, model_params=model_params)
    if choice.threads is not None and choice.threads != torch.get_num_threads():
        torch.set_num_threads(choice.threads)
    _settled = choice
    return choice
