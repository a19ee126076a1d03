"""The top-m factorization of a patch's Δ: the one routine every patch kind forms its factors with.

A patch keeps the top-``m`` singular directions of ``Δ [T, F]`` (``F = H_kv·d``) per layer and
tensor. A full float64 SVD of the tall ``Δ`` costs about as much as the conditioned forward that
measured it (it bidiagonalizes the whole ``[T, F]`` and forms ``U [T, F]``). The Gram route does
the ``T``-long work once, as a matrix product, and leaves an ``F × F`` eigenproblem:

    G = Δᵀ Δ  (float64)    G = V Λ Vᵀ    V_m: top-m eigenvectors    U_m S_m = Δ V_m

``Λ = S²``: the spectrum is Δ's squared singular values, and ``‖Δ V_m‖²`` per column is exactly
what :func:`~contextdeque.patch.alloc.layer_spectra` reads back. A chunk shorter than ``F`` takes
the transposed Gram ``Δ Δᵀ [T, T]`` (its top eigenvectors are ``U_m``) and one small SVD of
``U_mᵀ Δ [m, F]``, which yields orthonormal ``V_mᵀ`` rows even where Δ has fewer than ``m``
directions (dividing by a zero singular value is never needed).

Accuracy (measured in tests/test_patch_topm.py against the float64 SVD): squaring costs nothing
that a float32 Δ can hold: a float64 Gram resolves singular values down to ``≈ 1e-8 s_1``, below
a float32 Δ's own rounding (``≈ 6e-8 s_1``); the directions it does not resolve carry less energy
than that rounding. At full rank with ``T ≥ F`` ``V`` is a complete orthonormal basis and the
product reproduces Δ to rounding. The exact SVD is kept where the Gram does not pay or cannot
serve: a chunk shorter than ``F`` at more than half its rank (:func:`gram_serves`), and a
non-finite Δ (the SVD then raises or reports as it always did).

Conventions the callers rely on: fp32 ``(U_m S_m [..., T, m], V_mᵀ [..., m, F])`` on Δ's device,
directions in descending singular value, orthonormal ``V_mᵀ`` rows, and one sign per direction
(the largest-magnitude entry of each ``V_mᵀ`` row is positive), so both routes and both devices
return the same factors up to rounding.

On CUDA the same code runs batched over layers on the device in float64 (the Gram is one
batched GEMM; the ``F × F`` eigenproblems are what is left, and they do not grow with ``T``).

Two solvers take the Gram's top-m eigenvectors (``eig=``):

- ``"eigh"``: the full eigendecomposition of every Gram (LAPACK; on CUDA cuSOLVER's ``syevd``,
  one matrix at a time with host syncs: at SmolLM2's ``F = 192`` that is most of a patch's
  forming time on an H100). On the host a batch is spread over threads (linalg releases the GIL).
- ``"subspace"``: block subspace iteration on ``G`` in float64 (batched GEMMs and ``k × k``
  Cholesky factors; on CUDA each step is a replayed CUDA graph): ``k = m + p``
  columns (:data:`OVERSAMPLE`) from a seeded random block, each step ``span(X) ← span((G + δI) X)``
  computed as ``Z = X + R H̃⁻¹`` (``H = XᵀGX``, ``R = GX − XH ⟂ X``, ``H̃ = H + δI``) so that
  ``ZᵀZ = I + (RH̃⁻¹)ᵀ(RH̃⁻¹) ⪰ I`` and its Cholesky-QR cannot break down, however wide the
  spectrum or deficient the rank. At checks a Rayleigh–Ritz step (the small ``k × k``
  eigenproblem, on the host where the device has no batched solver for it) gives the Ritz pairs,
  and an item is done when every kept direction's residual ``‖G x_i − θ_i x_i‖ ≤ tol·θ_1``
  (:data:`RESIDUAL_TOL`). Items that are not done after :data:`MAX_STEPS` steps take ``eigh``
  (only those items); an all-zero Gram takes eigh's answer for it (the identity's columns).

How the iteration runs is a :class:`SubspaceSettings`: the block's oversampling, when the first
check comes, the step budget, where the checks' eigenproblems run (host threads, numpy, the
device), whether the batch keeps a stable size as items converge (a new size is a new CUDA graph
capture), and whether an iteration multiplies by ``G`` or ``G²``. The host runs the module
constants' settings; CUDA a named preset of :data:`CUDA_PRESETS` (:data:`CUDA_PRESET`, or
``$CONTEXTDEQUE_TOPM_CUDA``), picked by measurement: scripts/gpu_forming_sweep.py times each
preset on a device and checks its factors against the float64 SVD there (issue 21).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterator, Literal

import torch

from ..core.cooperative import checkpoint
from ..core.counters import Tally, adds
from ..core.errors import PatchError

Method = Literal["auto", "gram", "svd"]
METHODS: tuple[str, ...] = ("auto", "gram", "svd")

Eig = Literal["auto", "eigh", "subspace"]
EIGS: tuple[str, ...] = ("auto", "eigh", "subspace")

#: the eigen-solver ``eig="auto"`` takes per device type (others: ``"eigh"``), measured: on one CPU
#: thread ``subspace`` took 2.6–3.3x ``eigh``'s time on the default model's Δs at 256 / 1,024
#: tokens; on an H100 ``eigh`` (cuSOLVER) took 2.4x ``subspace``'s (docs/gpu.md, issue 21)
DEFAULT_EIG: dict[str, str] = {"cpu": "eigh", "cuda": "subspace"}

#: subspace iteration: extra columns beyond ``m`` (the convergence rate of direction i is
#: ``λ_{m+p+1} / λ_i``), the residual tolerance relative to ``θ_1``, the shift ``δ`` relative to
#: the Gram's largest diagonal entry, the step budget before an item falls back to ``eigh``, and
#: the steps before the first Rayleigh–Ritz check. The tolerance, measured against the oracle of
#: tests/test_patch_topm.py (p = 16): 1e-4 fails it on the default model's Δs, 1e-5 passes; 1e-8 leaves
#: margin (a rank-32 patched window's KL then matches the SVD's within 1e-7). These are the host's
#: settings; CUDA's are :data:`CUDA_PRESET`'s.
OVERSAMPLE = 32
RESIDUAL_TOL = 1e-8
SHIFT = 1e-10
MAX_STEPS = 40
FIRST_CHECK = 16

Ritz = Literal["host-pool", "host-serial", "host-1", "numpy", "numpy-pool", "device"]
RITZ: tuple[str, ...] = ("host-pool", "host-serial", "host-1", "numpy", "numpy-pool", "device")
Pad = Literal["none", "pow2", "full"]
PADS: tuple[str, ...] = ("none", "pow2", "full")


@dataclass(frozen=True)
class SubspaceSettings:
    """How the subspace iteration runs (every choice gives the same factors to the residual
    test's tolerance; they differ in time, per device).

    ``oversample``: ``p``, extra columns beyond ``m``. ``first_check``: iterations before the
    first Rayleigh–Ritz check. ``ritz``: where a check's ``[b, k, k]`` eigenproblems run when the
    caller does not say (``eig_device``): ``"host-pool"`` (the host, the batch cut over a thread
    pool: :data:`HOST_EIG_THREADS`), ``"host-serial"`` (the host, one LAPACK call), ``"host-1"``
    (the host, one call with torch's threads set to one around it: process-wide, so other
    threads' CPU work runs on one thread meanwhile), ``"numpy"`` (numpy's LAPACK, one call),
    ``"numpy-pool"`` (numpy's LAPACK over the thread pool), ``"device"`` (where the Gram is: on
    CUDA cuSOLVER, one matrix at a time above 32); a CUDA block of ``k ≤ 32`` runs on the device
    whatever this says (cuSOLVER's batched Jacobi). ``pad``: the batch the power steps run on as
    items converge: ``"none"`` (only the unfinished items: every new batch size is a new CUDA
    graph capture), ``"pow2"`` (padded to the next power of two with copies of unfinished
    items), ``"full"`` (the first batch's size throughout). ``power``: each iteration multiplies
    by ``G^power`` (``2``: one iteration does two steps' work for one step's kernels; the checks
    stay on ``G``, so the answers are ``G``'s. ``G²`` resolves directions down to
    ``s_i ≈ 1e-5 s_1`` (``λ²`` against rounding and the shift ``δ``): an item whose top ``k``
    spectrum is wider does not pass and takes ``eigh``, right but slower; the default model's
    real Δs have ``s_32 / s_1`` of 0.06–0.3). ``max_steps``: the step budget before an item
    falls back to ``eigh`` (on CUDA one ``eigh`` of an ``F × F`` Gram costs several graphed
    steps). ``kv_one_call``: a patch's K and V Δs (same shape and rank) factored in one batch
    (``PatchKind.factorize`` asks :func:`kv_in_one_call`): one set of checks and host round
    trips instead of two. ``pad_tokens``: a chunk shorter than ``F`` (its ``T × T`` Gram) padded
    with zero tokens to 64, 128, ... (at most ``F``): a few Gram sizes, each a CUDA graph shape,
    instead of one per chunk length. ``first_check`` counts iterations, ``max_steps`` (as the
    caller's ``max_steps``) steps of ``G``: one iteration of ``G^power`` makes ``power`` of them."""

    oversample: int = OVERSAMPLE
    first_check: int = FIRST_CHECK
    ritz: Ritz = "host-pool"
    pad: Pad = "none"
    power: int = 1
    max_steps: int = MAX_STEPS
    kv_one_call: bool = False
    pad_tokens: bool = False

    def __post_init__(self) -> None:
        if self.oversample < 0 or self.first_check < 1 or self.power not in (1, 2) or self.max_steps < 1:
            raise PatchError(f"subspace settings need oversample >= 0, first_check >= 1, max_steps >= 1 and power "
                             f"1 or 2: {self}")
        if self.ritz not in RITZ or self.pad not in PADS:
            raise PatchError(f"subspace settings: ritz one of {RITZ}, pad one of {PADS}: {self}")


#: named CUDA settings (the measured candidates of issue 21: scripts/gpu_forming_sweep.py times
#: each on a device and checks its factors against the float64 SVD there). ``graphed``: the
#: settings the H100 and H200 runs of 2026-11-26 measured (37 ms a rank-32 patch in the bench,
#: 72 ms in calibrate); a check there costs tens of graphed steps (the host's eigenproblems, syncs)
CUDA_PRESETS: dict[str, SubspaceSettings] = {
    "graphed": SubspaceSettings(oversample=32, first_check=32),
    # one factor changed at a time
    "p16": SubspaceSettings(oversample=16, first_check=48, max_steps=80),  # the H100 sweep's 20–25% (then capped at 40)
    "budget80": SubspaceSettings(oversample=32, first_check=32, max_steps=80),
    "ritz-serial": SubspaceSettings(oversample=32, first_check=32, ritz="host-serial"),
    "ritz-1": SubspaceSettings(oversample=32, first_check=32, ritz="host-1"),
    "ritz-numpy": SubspaceSettings(oversample=32, first_check=32, ritz="numpy"),
    "ritz-numpy-pool": SubspaceSettings(oversample=32, first_check=32, ritz="numpy-pool"),
    "ritz-device": SubspaceSettings(oversample=32, first_check=32, ritz="device"),
    "pow2": SubspaceSettings(oversample=32, first_check=32, pad="pow2"),
    "full": SubspaceSettings(oversample=32, first_check=32, pad="full"),
    "kv": SubspaceSettings(oversample=32, first_check=32, kv_one_call=True),
    "pad-tokens": SubspaceSettings(oversample=32, first_check=32, pad="pow2", pad_tokens=True),
    "squared": SubspaceSettings(oversample=32, first_check=16, power=2, max_steps=80),
    # combinations: G², padded batches and token counts, the Rayleigh–Ritz eigenproblems on one
    # host thread, over the pool by numpy, or on the device; p = 16; K and V in one call
    **{f"squared{p}-pow2-{ritz}{kv}": SubspaceSettings(
        oversample=16 if p else 32, first_check=24 if p else 16, ritz=ritz, pad="pow2", power=2, max_steps=80,
        kv_one_call=bool(kv), pad_tokens=True)
       for p in ("", "-p16") for ritz in ("host-1", "numpy-pool", "device") for kv in ("", "-kv")
       if not (ritz == "device" and (p or kv))},
}
#: CUDA's default preset (one of :data:`CUDA_PRESETS`); ``$CONTEXTDEQUE_TOPM_CUDA`` overrides it
#: for a process: a preset's name, or a JSON object of :class:`SubspaceSettings` fields over it.
#: Measured on an H200 2026-11-26 (scripts/gpu_forming_sweep.py, docs/gpu-results/h200/forming_sweep.json;
#: real SmolLM2 spectra, rank 32, K and V, mean over fresh Δs, 2 host threads): ``kv`` 1.34x
#: ``graphed`` (20.6 vs 31.1 ms at 512 tokens, 54.5 vs 68.5 at 128). The fastest,
#: ``squared-p16-pow2-host-1-kv``, was 1.42x but sets the process's torch threads to 1 around its
#: host eigenproblems (a foreground forward in another thread would run on one thread meanwhile)
#: and iterates on G² (items below ~1e-5 of s₁ fall back to eigh): 6% is not worth either
CUDA_PRESET = "kv"
CUDA_SETTINGS_ENV = "CONTEXTDEQUE_TOPM_CUDA"


@dataclass
class SubspaceCounts(Tally):
    """What the subspace iteration did in this process (:data:`SUBSPACE_COUNTS`; a benchmark
    resets it with ``SUBSPACE_COUNTS.reset()``): ``solves`` (batches it was called on),
    ``items`` (eigenproblems in them), ``iterations`` (power-step iterations, each on the whole
    padded batch), ``checks`` (Rayleigh–Ritz checks), ``fallback_items`` (items left to
    ``eigh``: not converged; an all-zero Gram takes eigh's answer without it),
    ``graph_captures`` (CUDA graphs captured)."""

    solves: int = adds()
    items: int = adds()
    iterations: int = adds()
    checks: int = adds()
    fallback_items: int = adds()
    graph_captures: int = adds()

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)


SUBSPACE_COUNTS = SubspaceCounts()


def solver_settings(device: "torch.device | str") -> SubspaceSettings:
    """The subspace iteration's settings on ``device``: the host's module constants
    (:data:`OVERSAMPLE`, :data:`FIRST_CHECK`) on the CPU; on CUDA :data:`CUDA_PRESET`'s, or what
    ``$CONTEXTDEQUE_TOPM_CUDA`` says.

    Raises:
        PatchError: ``$CONTEXTDEQUE_TOPM_CUDA`` names no preset and is no JSON object of fields.
    """
    if torch.device(device).type != "cuda":
        return SubspaceSettings(oversample=OVERSAMPLE, first_check=FIRST_CHECK, max_steps=MAX_STEPS)
    return parse_cuda_settings(os.environ.get(CUDA_SETTINGS_ENV, ""))


def parse_cuda_settings(text: str) -> SubspaceSettings:
    """``$CONTEXTDEQUE_TOPM_CUDA``'s value: ``""`` (:data:`CUDA_PRESET`), a preset's name, or a
    JSON object of :class:`SubspaceSettings` fields over :data:`CUDA_PRESET`'s (a ``"preset"``
    key picks another base)."""
    text = text.strip()
    if not text:
        return CUDA_PRESETS[CUDA_PRESET]
    if text in CUDA_PRESETS:
        return CUDA_PRESETS[text]
    try:
        fields = json.loads(text)
    except json.JSONDecodeError:
        fields = None
    if not isinstance(fields, dict):
        raise PatchError(f"${CUDA_SETTINGS_ENV}: a preset ({', '.join(CUDA_PRESETS)}) or a JSON object, got {text!r}")
    base = CUDA_PRESETS.get(fields.pop("preset", CUDA_PRESET))
    known = {f.name for f in dataclasses.fields(SubspaceSettings)}
    if base is None or set(fields) - known:
        raise PatchError(f"${CUDA_SETTINGS_ENV}: unknown preset or fields in {text!r}; fields: {sorted(known)}")
    return dataclasses.replace(base, **fields)


#: the float64 working set one batch of layers may take (the batch is cut into groups below it;
#: each group also gives background work a checkpoint)
GROUP_BYTES = 64 << 20


def truncated_svd(
    delta: torch.Tensor, rank: int, *, method: Method = "auto", eig: Eig = "auto",
    eig_device: "torch.device | str | None" = None, subspace: SubspaceSettings | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``rank`` factors of ``delta [..., T, F]`` (one Δ or a batch, e.g. one per layer):
    ``(U_m S_m [..., T, m], V_mᵀ [..., m, F])`` fp32 on ``delta``'s device, ``m = min(rank, T, F)``.

    ``method``: ``"auto"`` (the Gram route where it pays, :func:`gram_serves`, the float64 SVD
    elsewhere; the two agree to float32 rounding: see the module docstring), ``"gram"`` or
    ``"svd"`` (forced; ``"svd"`` is the oracle the tests hold the others to).
    ``eig``: the Gram route's eigen-solver, ``"eigh"`` or ``"subspace"`` (module docstring);
    ``"auto"``: :data:`DEFAULT_EIG` for ``delta``'s device type.
    ``eig_device``: where the eigenproblems run. ``"eigh"``: all of them (None: ``delta``'s
    device; e.g. ``"cpu"`` for a CUDA Δ, the Gram then crosses as ``[F, F]`` per item and ``V_m``
    comes back). ``"subspace"``: the iteration stays on ``delta``'s device; its small
    Rayleigh–Ritz eigenproblems and its fallback ``eigh`` run there (None: on the host for a CUDA
    block wider than 32: where :class:`SubspaceSettings`' ``ritz`` says, else on the device).
    ``subspace``: the subspace iteration's settings (None: :func:`solver_settings` of Δ's device).

    Raises:
        PatchError: ``delta`` is not at least 2-D, ``rank < 0``, an unknown ``method`` or ``eig``.
    """
    if delta.dim() < 2:
        raise PatchError(f"truncated_svd needs a [..., T, F] Δ, got shape {tuple(delta.shape)}")
    if rank < 0:
        raise PatchError(f"truncated_svd rank must be >= 0, got {rank}")
    if method not in METHODS:
        raise PatchError(f"unknown factorization method {method!r}; known: {METHODS}")
    if eig not in EIGS:
        raise PatchError(f"unknown eigen-solver {eig!r}; known: {EIGS}")
    if eig == "auto":
        eig = DEFAULT_EIG.get(delta.device.type, "eigh")  # type: ignore[assignment]
    *batch, T, F = delta.shape
    m = min(int(rank), T, F)
    # a chunk shorter than F: its T x T Gram padded with zero tokens to a few sizes (each Gram size
    # is a new CUDA graph shape; the top eigenvectors of the padded Gram are the Gram's, padded)
    settings = solver_settings(delta.device) if subspace is None else subspace
    n_gram = _token_bucket(T, F) if T < F and eig == "subspace" and settings.pad_tokens else min(T, F)
    if m == 0 or delta.numel() == 0:
        return delta.new_zeros(*batch, T, m, dtype=torch.float32), delta.new_zeros(*batch, m, F, dtype=torch.float32)
    flat = delta.reshape(-1, T, F)
    per_item = T * F * 8 * 3  # Δ in float64, its product with V, the Gram's share
    group = max(1, GROUP_BYTES // per_item)
    starts = range(0, flat.shape[0], group)
    factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    grams: dict[int, torch.Tensor] = {}  # the groups whose eigenproblems are solved together

    def solve_pending() -> None:
        # several groups' eigenproblems in one batch: one solve, one set of host syncs
        tops = top_eigenvectors(torch.cat(list(grams.values())), m, eig, eig_device, settings)
        for start, top in zip(grams, tops.split([len(g) for g in grams.values()])):
            checkpoint()
            # (padded tokens: their rows dropped; a direction reaching into them has eigenvalue 0,
            # so its row of U_mᵀ Δ is zero and the small SVD below still gives orthonormal V_mᵀ)
            factors[start] = _from_top_eigenvectors(flat[start:start + group].to(torch.float64), top[:, :T])
        grams.clear()

    for start in starts:
        if start:
            checkpoint()  # background formation gives way to foreground work between groups
        x = flat[start:start + group].to(torch.float64)
        if _takes_svd(x, m, method):
            factors[start] = _exact(x, m)
            continue
        gram = x.mT @ x if T >= F else x @ x.mT
        if n_gram > gram.shape[-1]:
            gram = torch.nn.functional.pad(gram, (0, n_gram - T, 0, n_gram - T))
        if grams and sum(g.numel() for g in grams.values()) * 8 + gram.numel() * 8 > GROUP_BYTES:
            solve_pending()
        grams[start] = gram
    if grams:
        solve_pending()
    us, vt = zip(*(factors[start] for start in starts))
    u, w = (torch.cat(us), torch.cat(vt)) if len(us) > 1 else (us[0], vt[0])
    u, w = _fix_signs(u, w)
    # contiguous: the Gram route's V_mᵀ is a transposed view, and a factor's layout decides the
    # summation order (bit-equality) of every product it enters
    return (u.to(torch.float32).contiguous().reshape(*batch, T, m),
            w.to(torch.float32).contiguous().reshape(*batch, m, F))


def kv_in_one_call(dk: torch.Tensor, dv: torch.Tensor, rank_k: int, rank_v: int,
                   subspace: SubspaceSettings | None = None) -> bool:
    """Whether a patch's K and V Δs (``[L, T, F]`` each) are factored in one batch
    (``torch.cat([dk, dv])``: one set of checks and host round trips instead of two): where the
    settings (None: :func:`solver_settings` of Δ's device) say ``kv_one_call`` and the two have
    the same shape, rank and device."""
    settings = solver_settings(dk.device) if subspace is None else subspace
    return settings.kv_one_call and dk.shape == dv.shape and rank_k == rank_v and dk.device == dv.device


def _token_bucket(n_tokens: int, width: int) -> int:
    """The size a ``[n_tokens, n_tokens]`` Gram is padded to (``n_tokens < width``): the next
    power of two, at least 64, at most ``width``."""
    return min(width, max(64, 1 << (n_tokens - 1).bit_length()))


def gram_serves(n_tokens: int, width: int, rank: int) -> bool:
    """Whether ``"auto"`` takes the Gram route for a ``[n_tokens, width]`` Δ at ``rank``: always
    when ``T ≥ F``; when ``T < F`` only for ``m ≤ T / 2`` (the transposed route's eigenproblem is
    ``T × T`` and it ends in an SVD of ``[m, F]``: measured on one CPU thread, it stops paying
    between ``m = T/2`` and ``m = 3T/4``)."""
    return n_tokens >= width or 2 * min(rank, n_tokens) <= n_tokens


def _takes_svd(x: torch.Tensor, m: int, method: str) -> bool:
    """Whether ``x [B, T, F]`` is factored by the float64 SVD rather than the Gram route."""
    T, F = x.shape[-2:]
    if method == "svd" or (method == "auto" and not gram_serves(T, F, m)):
        return True
    return method == "auto" and not bool(torch.isfinite(x).all())  # the SVD's own behaviour on a non-finite Δ


def _from_top_eigenvectors(x: torch.Tensor, top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors of ``x [B, T, F]`` from its Gram's top eigenvectors: ``V_m [B, F, m]`` of
    ``ΔᵀΔ`` (``T ≥ F``) or ``U_m [B, T, m]`` of ``ΔΔᵀ``. Float64 ``(U_m S_m, V_mᵀ)``, descending."""
    T, F = x.shape[-2:]
    if T >= F:
        return x @ top, top.mT
    # U_mᵀ Δ [m, F] has orthogonal rows of norms s; its small SVD gives orthonormal V_mᵀ rows
    # (also where s is zero) and sorts the directions
    A, S, Wh = torch.linalg.svd(top.mT @ x, full_matrices=False)
    return (top @ A) * S.unsqueeze(-2), Wh


def top_eigenvectors(
    gram: torch.Tensor, m: int, eig: str = "eigh", eig_device: "torch.device | str | None" = None,
    subspace: SubspaceSettings | None = None,
) -> torch.Tensor:
    """The top-``m`` eigenvectors of symmetric positive semi-definite ``gram [B, n, n]``
    (float64), descending: ``[B, n, m]`` on ``gram``'s device, by ``eig`` (``"eigh"`` or
    ``"subspace"``; see :func:`truncated_svd` for ``eig_device`` and ``subspace``)."""
    n = gram.shape[-1]
    settings = solver_settings(gram.device) if subspace is None else subspace
    if eig == "eigh" or m + settings.oversample >= n:  # a block as wide as G: the full eigh is the solver
        return _eigh_top(gram, m, eig_device)
    vecs, done = subspace_top_eigenvectors(gram, m, small_eig_device=eig_device, settings=settings)
    if not bool(done.all()):
        rest = (~done).nonzero().flatten()
        # an all-zero Gram: eigh's answer without a solver call (LAPACK's and cuSOLVER's
        # eigenvectors of a zero matrix are the identity's columns; every patch's first-layer V Δ is zero)
        zero = (gram[rest.to(gram.device)].flatten(1).abs().amax(1) == 0).cpu()
        if bool(zero.any()):
            vecs[rest[zero].to(vecs.device)] = _zero_gram_top(n, m, gram.dtype, gram.device)
        rest = rest[~zero]
        SUBSPACE_COUNTS.fallback_items += len(rest)
        if len(rest):
            vecs[rest.to(vecs.device)] = _eigh_top(gram[rest.to(gram.device)], m, eig_device)
    return vecs


def _zero_gram_top(n: int, m: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What :func:`_eigh_top` answers for an all-zero ``[n, n]`` Gram: the identity's last ``m``
    columns, last first (``eigh`` of a zero matrix: eigenvalues 0, eigenvectors the identity)."""
    return torch.eye(n, dtype=dtype, device=device)[:, n - m:].flip(-1)


def subspace_top_eigenvectors(
    gram: torch.Tensor, m: int, *, max_steps: int | None = None, tol: float | None = None,
    oversample: int | None = None, small_eig_device: "torch.device | str | None" = None,
    settings: SubspaceSettings | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block subspace iteration for the top-``m`` eigenvectors of PSD ``gram [B, n, n]``
    (float64): ``(vecs [B, n, m] descending, done [B] bool)``. ``done[b]``: every kept direction
    passed the residual test ``‖G x_i − θ_i x_i‖ ≤ tol·θ_1`` within ``max_steps`` steps of ``G``;
    the rows of ``vecs`` that are not done are zero (the caller solves those items another way).
    None: ``settings.max_steps``, :data:`RESIDUAL_TOL`, ``settings.oversample``; ``settings``
    None: :func:`solver_settings` of ``gram``'s device."""
    s = solver_settings(gram.device) if settings is None else settings
    max_steps = s.max_steps if max_steps is None else max_steps
    tol = RESIDUAL_TOL if tol is None else tol
    B, n, _ = gram.shape
    k = min(m + (s.oversample if oversample is None else oversample), n)
    peak = gram.diagonal(dim1=-2, dim2=-1).amax(-1)  # ≤ λ_1 ≤ n·peak: G/peak has λ_1 in [1, n]
    live = peak > 0  # an all-zero Gram has no directions to find: eigh's answer, as before
    g = gram / torch.where(live, peak, 1.0)[:, None, None]
    vecs = gram.new_zeros(B, n, m)
    done = torch.zeros(B, dtype=torch.bool)
    active = live.cpu().nonzero().flatten()
    g = g[active] if len(active) < B else g
    # the operator the iterations multiply by: G, or G² scaled back to λ_1 in [1, n] (the same
    # eigenvectors; the checks below stay on G, so the answer's accuracy is G's)
    op = g if s.power == 1 else _scaled_square(g)
    x = _start_block(n, k, gram.device).expand(len(active), n, k)
    padded = len(active)  # the batch the iterations run on ("full": the first one's)
    budget = max_steps // s.power  # iterations of op
    SUBSPACE_COUNTS.solves += 1
    SUBSPACE_COUNTS.items += B
    done_iters, iters = 0, min(s.first_check, budget)
    while len(active) and iters > 0:
        x = _power_steps(op, x, iters, _pad_to(len(active), padded, s.pad))
        done_iters += iters
        SUBSPACE_COUNTS.iterations += iters
        SUBSPACE_COUNTS.checks += 1
        x = _orthonormalize(x)  # a second Cholesky-QR pass: orthonormal to rounding for Rayleigh–Ritz
        y = g @ x
        theta, w = _eigh_small(x.mT @ y, small_eig_device, s.ritz)
        theta, w = theta.flip(-1), w.flip(-1)  # descending
        ritz = x @ w[..., :m]
        residual = (y @ w[..., :m] - ritz * theta[:, None, :m]).norm(dim=-2)  # [b, m]
        bound = tol * theta[:, :1]
        passed = (residual <= bound).all(-1)
        # iterations still needed: direction i's residual shrinks by ~ (θ_k / θ_i)^power an iteration
        rate = ((theta[:, k - 1:k] + SHIFT) / (theta[:, :m] + SHIFT)).pow(s.power).clamp(max=1 - 1e-3)
        need = (torch.log(bound / residual.clamp(min=1e-300)) / torch.log(rate)).clamp(min=0).amax(-1)
        # one transfer (one sync) for both
        passed_host, need_host = torch.stack([passed.to(need.dtype), torch.where(passed, 0.0, need)]).cpu()
        passed_host = passed_host.bool()
        finished = active[passed_host]
        vecs[finished.to(vecs.device)] = ritz[passed_host.to(ritz.device)]
        done[finished] = True
        keep = (~passed_host).nonzero().flatten()
        if len(keep) < len(active):
            on = keep.to(g.device)
            active, g, x = active[keep], g[on], x[on]
            op = g if s.power == 1 else op[on]
        left = budget - done_iters
        most = float(need_host.max()) if len(active) else 0.0
        # θ_k underestimates λ_{k+1}'s pull: a quarter more, and a step, so that one more check is the last
        iters = min(left, math.ceil(1.25 * most) + 1) if math.isfinite(most) else left  # NaN: run out, fall back
    return vecs, done


def _scaled_square(g: torch.Tensor) -> torch.Tensor:
    """``G²`` of ``g [b, n, n]`` divided by its largest diagonal entry (λ_1 back in [1, n])."""
    sq = g @ g
    peak = sq.diagonal(dim1=-2, dim2=-1).amax(-1)
    return sq / torch.where(peak > 0, peak, 1.0)[:, None, None]


def _pad_to(active: int, first: int, pad: str) -> int:
    """The batch size the power steps run ``active`` unfinished items on (``first``: the first
    batch's size; :class:`SubspaceSettings`' ``pad``)."""
    if pad == "full":
        return max(first, active)
    if pad == "pow2":
        return 1 << max(0, active - 1).bit_length()
    return active


#: CUDA: the power steps replay a captured CUDA graph of one step. Eagerly a step is ~70 small
#: kernel launches (batched Cholesky and triangular solves launch several each) whose host-side cost
#: (~1 ms on an H100's host, profiled) is ten times their GPU time; a replay is one launch.
CUDA_GRAPHS = True
_GRAPH_CACHE = 8  # captured shapes kept (batch sizes shrink as items converge)
_graphs: "OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]]" = OrderedDict()
_graphs_lock = threading.Lock()


def _power_steps(g: torch.Tensor, x: torch.Tensor, steps: int, batch: int | None = None) -> torch.Tensor:
    """``steps`` orthonormalized shifted power steps of ``x [b, n, k]`` on ``g [b, n, n]``, run
    on a batch of ``batch ≥ b`` items (None: ``b``): the rows past ``b`` repeat the first ones
    (every item's steps are its own; a stable batch size replays a captured CUDA graph instead
    of capturing a new one) and are dropped from the result."""
    b = x.shape[0]
    if batch is not None and batch > b:
        rows = torch.arange(batch, device=x.device) % b
        return _power_steps(g[rows], x[rows], steps)[:b]
    global CUDA_GRAPHS
    if CUDA_GRAPHS and g.is_cuda:
        try:
            return _graphed_power_steps(g, x, steps)
        except RuntimeError as exc:  # a capture this torch/driver refuses: eager from now on, same values
            CUDA_GRAPHS = False
            warnings.warn(f"topm: CUDA graph capture of the power step failed ({exc}); running it eagerly")
    for _ in range(steps):
        x = _orthonormalize(_shifted_power_step(g, x))
    return x


def _graphed_power_steps(g: torch.Tensor, x: torch.Tensor, steps: int) -> torch.Tensor:
    key = (g.device, *x.shape)
    with _graphs_lock:  # one capture and one set of static buffers per shape: replays are serialized
        entry = _graphs.pop(key, None)
        if entry is None:
            g_in, x_io = g.contiguous().clone(), x.contiguous().clone()
            side = torch.cuda.Stream(g.device)
            side.wait_stream(torch.cuda.current_stream(g.device))
            with torch.cuda.stream(side):  # warm-up off the capture: solver handles and workspaces
                for _ in range(2):
                    _orthonormalize(_shifted_power_step(g_in, x_io))
            torch.cuda.current_stream(g.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                x_io.copy_(_orthonormalize(_shifted_power_step(g_in, x_io)))
            entry = (graph, g_in, x_io)
            SUBSPACE_COUNTS.graph_captures += 1
        _graphs[key] = entry
        while len(_graphs) > _GRAPH_CACHE:
            _graphs.popitem(last=False)
        graph, g_in, x_io = entry
        g_in.copy_(g)
        x_io.copy_(x)
        for _ in range(steps):
            graph.replay()
        return x_io.clone()


def _shifted_power_step(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A block ``Z`` with ``span(Z) = span((G + δI) X)`` for orthonormal ``x [b, n, k]``:
    ``Z = X + R H̃⁻¹`` (``H = XᵀGX``, ``R = GX − XH``, ``H̃ = H + δI``). ``R ⟂ X``, so
    ``ZᵀZ = I + (RH̃⁻¹)ᵀ(RH̃⁻¹)``: its Cholesky factor exists however ill-conditioned ``GX`` is
    (``‖RH̃⁻¹‖² ≤ λ_1/δ``)."""
    y = g @ x
    h = x.mT @ y
    r = torch.baddbmm(y, x, h, alpha=-1)  # R = GX − XH
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
    chol, _ = torch.linalg.cholesky_ex(h + SHIFT * eye)  # H̃ = L Lᵀ (its lower triangle is read)
    # H̃⁻¹ = L⁻ᵀ L⁻¹ from the k × k triangular inverse: a solve on k rows, not on n, then GEMMs
    l_inv = torch.linalg.solve_triangular(chol, eye, upper=False)
    return torch.baddbmm(x, r, l_inv.mT @ l_inv)


def _orthonormalize(z: torch.Tensor) -> torch.Tensor:
    """Cholesky-QR: ``Q = Z R⁻¹`` with ``RᵀR = ZᵀZ`` (``ZᵀZ ⪰ I`` here, so ``R⁻¹`` is well
    conditioned and formed explicitly: a ``k × k`` triangular solve and a batched GEMM)."""
    chol, _ = torch.linalg.cholesky_ex(z.mT @ z)
    eye = torch.eye(z.shape[-1], dtype=z.dtype, device=z.device)
    return z @ torch.linalg.solve_triangular(chol, eye, upper=False).mT


@lru_cache(maxsize=16)
def _start_block(n: int, k: int, device: torch.device) -> torch.Tensor:
    """A seeded random orthonormal ``[n, k]`` float64 block (the same on every device)."""
    g = torch.Generator().manual_seed(0)
    return torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))[0].to(device)


def _eigh_small(
    h: torch.Tensor, eig_device: "torch.device | str | None", ritz: str = "host-pool"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rayleigh–Ritz's ``[b, k, k]`` eigenproblems (ascending) on ``eig_device``; None: where
    ``ritz`` says (:class:`SubspaceSettings`) for a CUDA ``k > 32`` (cuSOLVER batches ``syevj``
    only up to 32), else on ``h``'s device."""
    if eig_device is None and h.is_cuda and h.shape[-1] > 32 and ritz != "device":
        vals, vecs = _host_eigh(h.cpu(), ritz)
    elif eig_device is None and not h.is_cuda and ritz != "host-pool" and ritz != "device":
        vals, vecs = _host_eigh(h, ritz)
    else:
        vals, vecs = _eigh(h, eig_device)
    return vals.to(h.device), vecs.to(h.device)


def _host_eigh(a: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh`` of host ``a [B, n, n]`` as ``how`` says (:class:`SubspaceSettings`'
    ``ritz``: ``"host-pool"``, ``"host-serial"``, ``"host-1"``, ``"numpy"``)."""
    if how == "host-pool":
        return _eigh(a, None)
    if how in ("numpy", "numpy-pool"):
        import numpy as np  # transformers' dependency; only these choices need it

        def numpy_eigh(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            vals, vecs = np.linalg.eigh(part.numpy())
            return torch.from_numpy(vals), torch.from_numpy(vecs)

        return numpy_eigh(a) if how == "numpy" else _over_pool(numpy_eigh, a)
    if how == "host-1":
        with _one_torch_thread():
            return torch.linalg.eigh(a)
    return torch.linalg.eigh(a)


_threads_lock = threading.Lock()


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch's intra-op threads set to one around the block (process-wide: MKL's threads slow
    small eigenproblems), then restored; one such block at a time."""
    with _threads_lock:
        before = torch.get_num_threads()
        if before != 1:
            torch.set_num_threads(1)
        try:
            yield
        finally:
            if before != 1:
                torch.set_num_threads(before)


def _eigh_top(gram: torch.Tensor, m: int, eig_device: "torch.device | str | None") -> torch.Tensor:
    _, vecs = _eigh(gram, eig_device)  # ascending
    return vecs[..., -m:].flip(-1).to(gram.device)


#: threads a host batch of eigenproblems is spread over (None: ``torch.get_num_threads()``)
HOST_EIG_THREADS: int | None = None
_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def _eigh(a: torch.Tensor, device: "torch.device | str | None") -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh`` of ``a [B, n, n]`` on ``device`` (None: ``a``'s); on the host a
    batch is cut into one slice per thread (LAPACK's batched loop is serial; linalg releases the
    GIL)."""
    a = a if device is None else a.to(device)
    if a.is_cuda:
        return torch.linalg.eigh(a)
    return _over_pool(torch.linalg.eigh, a)


def _over_pool(
    eigh: "Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]", a: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``eigh`` of host ``a [B, n, n]``, the batch cut into one slice per thread of the pool
    (:data:`HOST_EIG_THREADS`; one slice, no pool, for one thread or one item)."""
    threads = HOST_EIG_THREADS or torch.get_num_threads()
    if threads < 2 or a.shape[0] < 2:
        return eigh(a)
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] < threads:  # grown when asked for more threads
            _pool = (threads, ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cdq-eigh"))
        pool = _pool[1]
    parts = list(pool.map(eigh, a.tensor_split(min(threads, a.shape[0]))))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _exact(x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    U, S, Vh = torch.linalg.svd(x, full_matrices=False)
    return U[..., :m] * S[..., None, :m], Vh[..., :m, :]


def _fix_signs(us: torch.Tensor, vt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sign per direction: the largest-magnitude entry of each ``V_mᵀ`` row positive."""
    peak = vt.gather(-1, vt.abs().argmax(-1, keepdim=True))  # [B, m, 1]
    sign = torch.where(peak < 0, -1.0, 1.0).to(vt.dtype)
    return us * sign.mT, vt * sign
