"""`OMP_NUM_THREADS=1 python scripts/budget_floor.py`: latency window (4 x 512, default model), recall of the page that slid out at the end, with
answer_kl_budget=3e-3 and no time cap: what the floor forms, its cost and the KL at answer time."""
import time, torch
import contextdeque as cd
from contextdeque.eval.window_bench import _chunks, _question
from contextdeque.eval.step_bench import _answer_logits, _reprefill, _window_ids
from contextdeque.core.metrics import kl_divergence
b = cd.load_model()
torch.set_num_threads(1)
pages = _chunks(b, 5, 512); q = _question(b)
win = cd.ContextWindow(b, budget_tokens=4 * 512, rank=32, answer_kl_budget=3e-3, kl_budget_ms=None)
old = win.append(chunk=b.encode(token_ids=pages[0])); win.heal()
for p in pages[1:]:
    win.append(chunk=b.encode(token_ids=p)); win.heal()
t = time.perf_counter(); r = win.recall(old, at="end"); step = (time.perf_counter() - t) * 1000
logits = _answer_logits(win, q); ttft = (time.perf_counter() - t) * 1000
ref, rp = _reprefill(b, _window_ids(win) + q)
print(f"recall at end, answer_kl_budget=3e-3: {r.forwards} fwd, step {step:.0f} ms, ttft {ttft:.0f} ms, re-prefill {rp:.0f} ms "
      f"(x{rp / ttft:.2f}), KL {kl_divergence(ref, logits):.2e}; estimate {r.budget.estimate:.3f} -> {r.budget.after:.3f}, "
      f"formed {r.budget.formed}, served {[w for _, w in r.served]}")
