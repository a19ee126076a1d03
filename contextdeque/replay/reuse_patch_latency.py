"""contextdeque's patch arm under the latency-first patch policy (``patch_policy="latency"``,
``window/policy_latency.py``): nothing but new content's own forward on the critical path.

New content costs what a prefix cache's append costs, one forward of its tokens after the window
(the provisional slot holds ``KV(B | window)``: exact for where it stands). Re-reads (recall,
reorder, the recall cascade) run no forward: a store hit where the store holds a valid patch,
else the slot keeps what it has and waits. The heal at the next step boundary (the agent's tool
time; ``ContextWindow.heal`` / the idle healer) computes the provisional chunks' canonicals (their
patch is the difference: no second forward) and does what the eager policy would on the window
as it then stands. Heal work is counted in ``tokens_prefilled`` and in ``heal_tokens`` /
``heal_seconds``, not in ``est_seconds`` (the critical path)."""

from .reuse_patch import PatchCost


class LatencyPatchCost(PatchCost):
    name = "patch-latency"
    arm = "patch"
    window_policy = "latency"
