"""Live window vs replay on the default model (SmolLM2-135M) with default window settings (latency-first,
anticipation on, the session predictor), rank 8, the agents' generated traces scaled 1/64 as in the
equality test, on a device / host / disk store whose device and host budgets make it spill (bytes;
default 3,000,000 and 9,000,000: the default model's KV is 46,080 B a token). Prints the counts and the
bytes each tier read, wrote and evicted, live and replayed.
Usage: OMP_NUM_THREADS=1 python scripts/replay_vs_window.py doc,web,video [DEVICE_BYTES,HOST_BYTES]"""
import sys, time
from contextdeque.model.load import load_model
from contextdeque.replay import ReplayConfig, Replayer
from contextdeque.replay.cost import CostModel
from contextdeque.replay.fidelity import trace_chunk_ids
from contextdeque.replay.live import drive_window
from contextdeque.traces import generate, scaled_trace
from contextdeque.stores import MemoryTier, TieredStore
from contextdeque.window import ContextWindow
from contextdeque.window.plan import stored_bytes
import contextdeque.scheduler  # noqa

kinds = sys.argv[1].split(",") if len(sys.argv) > 1 else ["doc"]
device_bytes, host_bytes = map(int, (sys.argv[2] if len(sys.argv) > 2 else "3000000,9000000").split(","))
backend = load_model()
backend.root_kv()
rank = 8
for kind in kinds:
    trace = scaled_trace(generate(kind, seed=0), 1 / 64, minimum=2)
    t0 = time.time()
    store = TieredStore([MemoryTier("cpu", device_bytes, name="device"), MemoryTier("cpu", host_bytes, name="host"),
                         MemoryTier("cpu", None, name="disk")])
    win = ContextWindow(backend, rank=rank, beyond_trained=True, store=store)
    f0 = backend.forwards_run
    ids = trace_chunk_ids(backend, trace)  # (distinct contents, distinct tokens: the video trace has two that collide)
    live = drive_window(win, trace, lambda ev: ids[ev.id])
    ran = backend.forwards_run - f0
    cost = CostModel.geometry_of(backend, storage_bytes=4, rank=rank)
    from contextdeque.replay.reuse import REUSE_COSTS
    policy = win._ctx.policy.name
    rule = next(n for n, c in REUSE_COSTS.items() if c.window_policy == policy)
    r = Replayer(trace, "arrival", "lru", rule, cost, ReplayConfig(rank=rank, anticipate=win._ctx.config.anticipate,
                                                                  device_bytes=device_bytes, host_bytes=host_bytes)).run()
    q = [e for e in trace.events if e.op == "query"]
    pred = {"forwards": r.forwards - len(q), "tokens_prefilled": r.tokens_prefilled - sum(x.tokens for x in q), "encodes": r.encodes, "stored": dict(r.stored)}
    got = {"forwards": live.forwards, "tokens_prefilled": live.tokens_prefilled, "encodes": live.encodes, "stored": stored_bytes(live.plan)}
    tr = store.total_traffic
    traffic = {"read": tr.read, "written": tr.written, "evicted": tr.evicted}
    print(kind, "policy", policy, "anticipate", win._ctx.config.anticipate, "rule", rule,
          "| live", got, "| backend ran", ran, "| replay", pred, "| equal", got == pred, f"| {time.time() - t0:.0f}s", flush=True)
    print(f"  bytes per tier (device {device_bytes:,} B, host {host_bytes:,} B, disk unbounded); equal: {traffic == r.traffic}")
    for what in ("read", "written", "evicted"):
        for tier in ("device", "host", "disk"):
            a, b = traffic[what].get(tier, 0), r.traffic[what].get(tier, 0)
            print(f"  {what:8s} {tier:7s} live {a:>13,}  replay {b:>13,}  {'=' if a == b else 'DIFF'}", flush=True)
