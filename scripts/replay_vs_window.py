"""Live window vs replay on the default model (SmolLM2-135M) with default window settings (latency-first,
anticipation on, the session predictor), rank 8, the agents' generated traces scaled 1/64 as in the
equality test. Usage: OMP_NUM_THREADS=1 python scripts/replay_vs_window.py doc,web,video"""
import sys, time
from contextdeque.model.load import load_model
from contextdeque.replay import ReplayConfig, Replayer
from contextdeque.replay.cost import CostModel
from contextdeque.replay.fidelity import trace_chunk_ids
from contextdeque.replay.live import drive_window
from contextdeque.traces import generate, scaled_trace
from contextdeque.stores import MemoryTier
from contextdeque.window import ContextWindow
from contextdeque.window.plan import stored_bytes
import contextdeque.scheduler  # noqa

kinds = sys.argv[1].split(",") if len(sys.argv) > 1 else ["doc"]
backend = load_model()
backend.root_kv()
rank = 8
for kind in kinds:
    trace = scaled_trace(generate(kind, seed=0), 1 / 64, minimum=2)
    t0 = time.time()
    win = ContextWindow(backend, rank=rank, beyond_trained=True, store=[MemoryTier("cpu", None, name="device")])
    f0 = backend.forwards_run
    ids = trace_chunk_ids(backend, trace)  # (distinct contents, distinct tokens: the video trace has two that collide)
    live = drive_window(win, trace, lambda ev: ids[ev.id])
    ran = backend.forwards_run - f0
    cost = CostModel.geometry_of(backend, storage_bytes=4, rank=rank)
    from contextdeque.replay.reuse import REUSE_COSTS
    policy = win._ctx.policy.name
    rule = next(n for n, c in REUSE_COSTS.items() if c.window_policy == policy)
    r = Replayer(trace, "arrival", "lru", rule, cost, ReplayConfig(rank=rank, anticipate=win._ctx.config.anticipate)).run()
    q = [e for e in trace.events if e.op == "query"]
    pred = {"forwards": r.forwards - len(q), "tokens_prefilled": r.tokens_prefilled - sum(x.tokens for x in q), "encodes": r.encodes, "stored": dict(r.stored)}
    got = {"forwards": live.forwards, "tokens_prefilled": live.tokens_prefilled, "encodes": live.encodes, "stored": stored_bytes(live.plan)}
    print(kind, "policy", policy, "anticipate", win._ctx.config.anticipate, "rule", rule,
          "| live", got, "| backend ran", ran, "| replay", pred, "| equal", got == pred, f"| {time.time() - t0:.0f}s", flush=True)
