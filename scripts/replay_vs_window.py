"""Live window vs replay on the default model (SmolLM2-135M) with default window settings (latency-first,
anticipation on, the session predictor), rank 8, the agents' generated traces scaled 1/64 as in the
equality test, on a device / host / disk store whose device and host budgets make it spill (bytes;
default 3,000,000 and 9,000,000: the default model's KV is 46,080 B a token). Prints the counts and the
bytes each tier read, wrote and evicted, live and replayed. ``--diverge``: both tier stacks keep a
journal (``TieredStore.journal``) and, where the bytes differ, the first store operation that moved
other bytes is printed with its neighbours, live and replayed (keys named by first use: chunk#3, patch#7).
Usage: OMP_NUM_THREADS=1 python scripts/replay_vs_window.py doc,web,video [DEVICE_BYTES,HOST_BYTES] [--diverge]"""
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

diverge = "--diverge" in sys.argv
args = [a for a in sys.argv[1:] if a != "--diverge"]
kinds = args[0].split(",") if args else ["doc"]
device_bytes, host_bytes = map(int, (args[1] if len(args) > 1 else "3000000,9000000").split(","))


def journal_rows(journal):
    """A tier stack's journal as comparable rows: keys named by kind and first use (the live
    window's keys and the replay's differ: ``chunk/<model>/<hash>`` vs ``c/<content>``)."""
    names: dict[str, str] = {}
    rows = []
    for op, key, tr in journal:
        head = key.split("/", 1)[0]
        kind = {"chunk": "chunk", "c": "chunk", "embeds": "embeds", "pfx": "prefix"}.get(head, "patch")
        if key not in names:
            names[key] = f"{kind}#{sum(n.startswith(kind + '#') for n in names.values()) + 1}"
        rows.append((op, names[key], dict(tr.read), dict(tr.written), dict(tr.evicted)))
    return rows


def first_divergence(live_journal, replay_journal, around: int = 6) -> None:
    a, b = journal_rows(live_journal), journal_rows(replay_journal)
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    print(f"  first divergence: store operation {i} (of {len(a)} live, {len(b)} replayed)")
    for j in range(max(0, i - around), min(max(len(a), len(b)), i + around)):
        for side, rows in (("live  ", a), ("replay", b)):
            print(f"  {'>' if j == i else ' '}{j:5d} {side} {rows[j] if j < len(rows) else '-'}")
backend = load_model()
backend.root_kv()
rank = 8
for kind in kinds:
    trace = scaled_trace(generate(kind, seed=0), 1 / 64, minimum=2)
    t0 = time.time()
    store = TieredStore([MemoryTier("cpu", device_bytes, name="device"), MemoryTier("cpu", host_bytes, name="host"),
                         MemoryTier("cpu", None, name="disk")])
    store.journal = [] if diverge else None
    win = ContextWindow(backend, rank=rank, beyond_trained=True, store=store)
    f0 = backend.forwards_run
    ids = trace_chunk_ids(backend, trace)  # (distinct contents, distinct tokens: the video trace has two that collide)
    live = drive_window(win, trace, lambda ev: ids[ev.id])
    ran = backend.forwards_run - f0
    cost = CostModel.geometry_of(backend, storage_bytes=4, rank=rank)
    from contextdeque.replay.reuse import REUSE_COSTS
    policy = win._ctx.policy.name
    rule = next(n for n, c in REUSE_COSTS.items() if c.window_policy == policy)
    replayer = Replayer(trace, "arrival", "lru", rule, cost, ReplayConfig(rank=rank, anticipate=win._ctx.config.anticipate,
                                                                         device_bytes=device_bytes, host_bytes=host_bytes))
    replayer.pool.store.journal = [] if diverge else None
    r = replayer.run()
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
    if diverge and traffic != r.traffic:
        first_divergence(store.journal, replayer.pool.store.journal)
