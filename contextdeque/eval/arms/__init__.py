"""Reuse arms: every way of producing the KV of ``[root, chunk_1 .. chunk_N]``, one class per file.

``ARMS`` maps names to classes (each registers itself); :func:`make_arm` builds one by name::

    from contextdeque.eval.arms import ReuseRequest, make_arm
    req = ReuseRequest(backend, chunks)
    out = make_arm("cacheblend", ratio=0.15).run(req)   # out.kv, out.report
"""

from . import blind, cacheblend, epic, kvcapsule, kvselect, patch, prefix_cache, reprefill, vlcache  # noqa: F401  (register arms)
from .base import ARMS, ArmReport, ArmResult, ReuseArm, ReuseRequest, kv_row_bytes, make_arm, matched_token_budget
from .blind import BlindArm
from .cacheblend import CacheBlendArm
from .epic import EpicArm
from .kvcapsule import KVCapsuleArm
from .kvselect import KVSelectArm, MMShiftKVArm, SelectionResult, SnapKVArm, StreamingLLMArm
from .patch import PatchArm
from .prefix_cache import PrefixCacheArm
from .recompute import recompute_in_context
from .reprefill import ReprefillArm
from .vlcache import ProfileSample, VLCacheArm, linear_schedule, profile_schedule

__all__ = [
    "ARMS",
    "ArmReport",
    "ArmResult",
    "ReuseArm",
    "ReuseRequest",
    "make_arm",
    "kv_row_bytes",
    "matched_token_budget",
    "BlindArm",
    "CacheBlendArm",
    "EpicArm",
    "KVCapsuleArm",
    "KVSelectArm",
    "MMShiftKVArm",
    "SnapKVArm",
    "StreamingLLMArm",
    "SelectionResult",
    "PatchArm",
    "PrefixCacheArm",
    "ReprefillArm",
    "VLCacheArm",
    "ProfileSample",
    "recompute_in_context",
    "linear_schedule",
    "profile_schedule",
]
