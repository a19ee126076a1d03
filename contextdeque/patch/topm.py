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
"""

from __future__ import annotations

from typing import Literal

import torch

from ..core.cooperative import checkpoint
from ..core.errors import PatchError

Method = Literal["auto", "gram", "svd"]
METHODS: tuple[str, ...] = ("auto", "gram", "svd")

#: the float64 working set one batch of layers may take (the batch is cut into groups below it;
#: each group also gives background work a checkpoint)
GROUP_BYTES = 64 << 20


def truncated_svd(
    delta: torch.Tensor, rank: int, *, method: Method = "auto", eig_device: "torch.device | str | None" = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``rank`` factors of ``delta [..., T, F]`` (one Δ or a batch, e.g. one per layer):
    ``(U_m S_m [..., T, m], V_mᵀ [..., m, F])`` fp32 on ``delta``'s device, ``m = min(rank, T, F)``.

    ``method``: ``"auto"`` (the Gram route where it pays, :func:`gram_serves`, the float64 SVD
    elsewhere; the two agree to float32 rounding: see the module docstring), ``"gram"`` or
    ``"svd"`` (forced; ``"svd"`` is the oracle the tests hold the others to).
    ``eig_device``: where the Gram route's small eigenproblems run (None: ``delta``'s device; e.g.
    ``"cpu"`` for a CUDA Δ, the Gram then crosses as ``[F, F]`` per item and ``V_m`` comes back).

    Raises:
        PatchError: ``delta`` is not at least 2-D, ``rank < 0`` or an unknown ``method``.
    """
    if delta.dim() < 2:
        raise PatchError(f"truncated_svd needs a [..., T, F] Δ, got shape {tuple(delta.shape)}")
    if rank < 0:
        raise PatchError(f"truncated_svd rank must be >= 0, got {rank}")
    if method not in METHODS:
        raise PatchError(f"unknown factorization method {method!r}; known: {METHODS}")
    *batch, T, F = delta.shape
    m = min(int(rank), T, F)
    if m == 0 or delta.numel() == 0:
        return delta.new_zeros(*batch, T, m, dtype=torch.float32), delta.new_zeros(*batch, m, F, dtype=torch.float32)
    flat = delta.reshape(-1, T, F)
    per_item = T * F * 8 * 3  # Δ in float64, its product with V, the Gram's share
    group = max(1, GROUP_BYTES // per_item)
    us, vt = [], []
    for start in range(0, flat.shape[0], group):
        if start:
            checkpoint()  # background formation gives way to foreground work between groups
        u, w = _factor(flat[start:start + group].to(torch.float64), m, method, eig_device)
        us.append(u), vt.append(w)
    u, w = (torch.cat(us), torch.cat(vt)) if len(us) > 1 else (us[0], vt[0])
    u, w = _fix_signs(u, w)
    # contiguous: the Gram route's V_mᵀ is a transposed view, and a factor's layout decides the
    # summation order (bit-equality) of every product it enters
    return (u.to(torch.float32).contiguous().reshape(*batch, T, m),
            w.to(torch.float32).contiguous().reshape(*batch, m, F))


def gram_serves(n_tokens: int, width: int, rank: int) -> bool:
    """Whether ``"auto"`` takes the Gram route for a ``[n_tokens, width]`` Δ at ``rank``: always
    when ``T ≥ F``; when ``T < F`` only for ``m ≤ T / 2`` (the transposed route's eigenproblem is
    ``T × T`` and it ends in an SVD of ``[m, F]``: measured on one CPU thread, it stops paying
    between ``m = T/2`` and ``m = 3T/4``)."""
    return n_tokens >= width or 2 * min(rank, n_tokens) <= n_tokens


def _factor(x: torch.Tensor, m: int, method: str, eig_device: "torch.device | str | None") -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, T, F]`` float64 -> float64 ``(U_m S_m [B, T, m], V_mᵀ [B, m, F])``, descending."""
    T, F = x.shape[-2:]
    if method == "svd" or (method == "auto" and not gram_serves(T, F, m)):
        return _exact(x, m)
    if method == "auto" and not bool(torch.isfinite(x).all()):
        return _exact(x, m)  # the SVD's own behaviour on a non-finite Δ, unchanged
    if T >= F:
        Vm = _top_eigenvectors(x.mT @ x, m, eig_device)  # [B, F, m]
        return x @ Vm, Vm.mT
    Um = _top_eigenvectors(x @ x.mT, m, eig_device)  # [B, T, m]
    # U_mᵀ Δ [m, F] has orthogonal rows of norms s; its small SVD gives orthonormal V_mᵀ rows
    # (also where s is zero) and sorts the directions
    A, S, Wh = torch.linalg.svd(Um.mT @ x, full_matrices=False)
    return (Um @ A) * S.unsqueeze(-2), Wh


def _top_eigenvectors(gram: torch.Tensor, m: int, eig_device: "torch.device | str | None") -> torch.Tensor:
    """The top-``m`` eigenvectors of symmetric ``gram [B, n, n]``, descending: ``[B, n, m]``."""
    _, vecs = torch.linalg.eigh(gram if eig_device is None else gram.to(eig_device))  # ascending
    return vecs[..., -m:].flip(-1).to(gram.device)


def _exact(x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    U, S, Vh = torch.linalg.svd(x, full_matrices=False)
    return U[..., :m] * S[..., None, :m], Vh[..., :m, :]


def _fix_signs(us: torch.Tensor, vt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sign per direction: the largest-magnitude entry of each ``V_mᵀ`` row positive."""
    peak = vt.gather(-1, vt.abs().argmax(-1, keepdim=True))  # [B, m, 1]
    sign = torch.where(peak < 0, -1.0, 1.0).to(vt.dtype)
    return us * sign.mT, vt * sign
