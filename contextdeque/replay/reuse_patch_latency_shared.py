"""contextdeque's patch arm under ``patch_policy="latency-shared"``
(``window/policy_latency_shared.py``): the critical path of ``patch-latency``, with every
canonical computed while healing (new content's patch is then the difference, no second forward;
a chunk that left before the heal gets its canonical all the same), so the store holds each
chunk for other windows and processes. One forward per chunk more than ``patch-latency``, in
idle time."""

from .reuse_patch_latency import LatencyPatchCost


class SharedLatencyPatchCost(LatencyPatchCost):
    name = "patch-latency-shared"
    arm = "patch"
    window_policy = "latency-shared"
