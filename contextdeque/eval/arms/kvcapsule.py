"""KVCapsule (linear variant): every chunk stored compressed at rest, reconstructed, relocated,
and patched.

Per chunk, the :class:`~contextdeque.capsule.CapsuleBank` supplies the basis for its length and
modality (fitted once from calibration chunks); the chunk is compressed (kept key rows, value
coefficients and mean), reconstructed in the content frame, relocated to its start and given the
same rank-``rank`` conditioning patch the ``patch`` arm would (``rank=None``: no patch, the
compressed canonicals alone). Zero serve-time forwards; the report says what the compression
saved and cost (``bytes_canonical`` = the capsules' bytes, ``recon_error_k`` / ``recon_error_v``
= relative Frobenius reconstruction error over the request's chunks, ``bytes_saved_fraction``).
"""

from __future__ import annotations

import math
from typing import Any

from ...core.capsule import DEFAULT_RETENTION, CapsuleBank
from ...core.errors import ReuseArmError
from ...core.kv import concat_kv
from ...core.operator import relocate
from .base import ArmResult, ReuseArm, ReuseRequest
from .patch import PatchArm
from ...patch.rank import DEFAULT_RANK


class KVCapsuleArm(ReuseArm):
    """Compressed-at-rest canonicals (+ a rank-``rank`` patch on non-leading chunks).

    ``bank``: the bases (a :class:`CapsuleBank`; one with ``calibrate=`` fits missing bases on
    first use); ``rank``: patch rank (None: no patch); ``patch_kind``/``**patch_options`` as the
    patch arm's.
    """

    name = "kvcapsule-linear"

    def __init__(self, bank: CapsuleBank | None = None, *, retention: float = DEFAULT_RETENTION,
                 rank: int | str | None = DEFAULT_RANK, label: str | None = None, **patch_options: Any) -> None:
        super().__init__(label=label or ("kvcapsule-linear" if rank is not None else "kvcapsule-linear-blind"))
        self.bank = bank if bank is not None else CapsuleBank(retention)
        if not isinstance(self.bank, CapsuleBank):
            raise ReuseArmError(f"bank must be a CapsuleBank, got {type(self.bank).__name__}")
        self.rank = rank
        self.patch_options = patch_options

    def run(self, request: ReuseRequest) -> ArmResult:
        be = request.backend
        rep = self.new_report(request)
        if self.rank is not None:
            pats, rep.compile_forwards = PatchArm(self.rank, **self.patch_options).patches(request)
        else:
            pats = [[] for _ in request.chunks]
        parts = [be.root_kv()]
        err_k = err_v = ref_k = ref_v = 0.0
        cap_bytes = 0
        for i, (chunk, start) in enumerate(zip(request.chunks, request.starts)):
            basis = self.bank.basis_for(chunk)
            cap = basis.compress(chunk)
            rec = basis.reconstruct(cap)
            cap_bytes += cap.nbytes
            err_k += float((rec.keys.double() - chunk.keys.double()).pow(2).sum())
            err_v += float((rec.values.double() - chunk.values.double()).pow(2).sum())
            ref_k += float(chunk.keys.double().pow(2).sum())
            ref_v += float(chunk.values.double().pow(2).sum())
            parts.append(relocate(rec, start, layout=be.layout, patch=pats[i] or None))
        rep.bytes_canonical = cap_bytes
        rep.bytes_extra = sum(p.nbytes for ps in pats for p in ps)
        rep.extras.update({
            "recon_error_k": math.sqrt(err_k / max(ref_k, 1e-300)),
            "recon_error_v": math.sqrt(err_v / max(ref_v, 1e-300)),
            "bytes_saved_fraction": 1.0 - cap_bytes / max(1, request.page_bytes),
            "capsule_bytes": cap_bytes,
            "bases": len(self.bank),
            "basis_bytes": sum(b.nbytes for b in self.bank.bases()),
        })
        return ArmResult(kv=concat_kv(parts), next_position=request.next_position, report=rep)
