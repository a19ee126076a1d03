"""Anticipation hit rate per trace and step type without the KL queries (issue 21): the replay's
real window driven as `replay --fidelity N --idle-rate R --placement arrival --patch-policy latency`
drives it (latency-first, anticipation on, the session predictor, the traces' hints, scale 1/16),
the idle budget `idle_ms / 1000 x R x scale` tokens, a forming charged `--fc` per factorized token
(the window's factorization_cost) and `--fixed` per patch, every forward `--forward-fixed` beside its
tokens, both in full-scale prefill tokens (e.g. a 35 ms factorization at R tokens/s: 0.035 x R),
passed to the window x scale like the chunks and the budget (the window's factorization_fixed and
forward_fixed). `--calibration FILE` takes R and all three from a cost model as
`replay --idle-rate calibrated --calibration FILE` does (replay.fidelity.idle_charges: R is the
marginal prefill rate at 2,048 tokens, a forward's fixed part charged apart). Prints every
counted step the window did not answer fresh (-v: every one) and the per-type table.
`--micro`: a 2-layer random llama instead of the default model (the budget is in tokens, so the
hits depend on the model only through the prepared re-forwards' byte bound); `--unpinned`: trace
recalls without an index go where recall(ref) puts them. Each trace's line ends with the forming
carried across gaps (window.forming: tokens banked, credited to preparations that ran, lost).
`--cascade keep`: a recall's dependents kept as-is (a what-if: the replay prices only "reform").
Usage: OMP_NUM_THREADS=1 python scripts/hit_rate.py doc-0.jsonl web-0.jsonl --rate 15000 --fc 0.449 --fixed 1648
   or: OMP_NUM_THREADS=1 python scripts/hit_rate.py doc-0.jsonl --calibration docs/gpu-results/h100/calibration-2026-11-26-subspace.json"""
import sys, json, time, argparse
import torch
torch.set_num_threads(1)
from contextdeque.model import load_model
from contextdeque.window import ContextWindow
from contextdeque.replay.live import drive_window, idle_budget
from contextdeque.replay.hits import HitRate, RE_READS
from contextdeque.replay.fidelity import DEFAULT_SCALE, scaled_chunk_ids
from contextdeque.traces.io import read_trace

ap = argparse.ArgumentParser()
ap.add_argument("traces", nargs="+")
ap.add_argument("--rate", type=float, default=1e9)
ap.add_argument("--placement", default="arrival")
ap.add_argument("-v", action="store_true")
ap.add_argument("--json", default=None)
ap.add_argument("--fc", type=float, default=0.0)
ap.add_argument("--fixed", type=float, default=0.0, help="prefill tokens (full scale) charged per patch factorized")
ap.add_argument("--forward-fixed", type=float, default=0.0, help="prefill tokens (full scale) charged per forward")
ap.add_argument("--calibration", default=None, help="a cost model: --rate, --fc, --fixed and --forward-fixed from it")
ap.add_argument("--ignore-hints", action="store_true", help="do not pass the traces' expect events on")
ap.add_argument("--micro", action="store_true")
ap.add_argument("--unpinned", action="store_true")
ap.add_argument("--upto", type=int, default=None)
ap.add_argument("--scale", type=float, default=DEFAULT_SCALE)
ap.add_argument("--cascade", default="reform", help="the window's cascade_policy (keep: a recall's dependents kept as-is)")
a = ap.parse_args()
ap2 = None
if a.micro:
    from transformers import LlamaConfig, LlamaForCausalLM
    from contextdeque.model.hf import HFBackend
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16384, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(11)
    backend = HFBackend(LlamaForCausalLM(cfg).eval(), None, root_ids=[1, 3], name="micro-diag")
else:
    backend = load_model()
scale = a.scale
if a.calibration:
    from contextdeque.replay.fidelity import idle_charges, idle_token_s
    from contextdeque.scheduler.cost_model import load_calibration
    cost, note = load_calibration(path=a.calibration)
    charges = idle_charges(cost, 1.0)
    a.rate, a.fc, a.fixed, a.forward_fixed = (1.0 / idle_token_s(cost), charges["factorization_cost"],
                                              charges["factorization_fixed"], charges["forward_fixed"])
    print(f"{note}: rate {a.rate:.0f} tok/s, fc {a.fc:.4g}, fixed {a.fixed:.0f}, forward_fixed {a.forward_fixed:.0f} "
          f"(full-scale prefill tokens)")
out = {}
for path in a.traces:
    t = read_trace(path)
    if a.upto:
        t.events[:] = t.events[: a.upto]
    win = ContextWindow(backend, placement=a.placement, patch_policy="latency", anticipate=True, recall_predictor="session", factorization_cost=a.fc,
                        factorization_fixed=a.fixed * scale, forward_fixed=a.forward_fixed * scale, cascade_policy=a.cascade)
    hits = HitRate()
    labels = {}
    def on_step(step, rec, hits=hits):
        hits.add(step, rec)
        if step in RE_READS + ("evict", "commit", "discard") and (a.v or not rec.answered_fresh):
            lab = lambda r: r.label or r.key
            print(f"  {step:9s} fresh={rec.answered_fresh} fw={rec.forwards} tok={rec.tokens_prefilled} refs={[lab(r) for r in rec.refs]} "
                  f"served={[(lab(r), w) for r, w in rec.served]} deferred={[(lab(r), s) for r, s, _ in rec.deferred]} placed={[(lab(r), i, w) for r,i,w in rec.placed]}")
    t0 = time.time()
    idle = idle_budget(a.rate, scale)
    print(f"== {t.name} rate={a.rate:.0f} fc={a.fc:.4g} fixed={a.fixed:.0f} forward_fixed={a.forward_fixed:.0f} "
          f"(x scale {scale:g}: {a.fixed * scale:.1f} per patch, {a.forward_fixed * scale:.1f} per forward)")
    total = drive_window(win, t, scaled_chunk_ids(backend, scale),
                         heal_at_end=False, on_step=on_step, idle_tokens=idle, pin_recalls=not a.unpinned,
                         hints=not a.ignore_hints)
    d = hits.as_dict()
    print(f"{t.name}: hit_rate={d['hit_rate']} own={d['own_hit_rate']} re_reads={d['re_reads']} "
          + " ".join(f"{k}:{v['hits']}/{v['steps']}(own {v['own_hits']})" for k, v in d["by_step"].items())
          + f"  forming banked={win.forming.banked:.0f} used={win.forming.used:.0f} lost={win.forming.lost:.0f}"
          + f"  [{time.time()-t0:.0f}s]", flush=True)
    out[t.name] = d
if a.json:
    json.dump(out, open(a.json, "w"), indent=1)
