"""Where a chunk encode and a patch's forming spend their time on a device: torch.profiler tables
(top ops by self CPU time and by self device time) for `backend.encode` of 64 and 2,048 tokens and
`form_patch` of a 256-token chunk on a 256-token antecedent, with the wall time of each beside the
sum of its kernels' device time (a wall far above the device time means host overhead: Python,
launches, syncs). SmolLM2-135M's architecture with random weights (timings do not depend on them).

Usage (on a CUDA machine, from the repository root with the package importable):
    python scripts/gpu_profile.py [--device cuda] [--rows 15]
On the CPU (`--device cpu --tiny`) it runs the same steps on a tiny llama, to check the script.
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from contextdeque.eval.gpu_check import SMOLLM2_135M_CONFIG, random_llama
from contextdeque.model.hf import HFBackend
from contextdeque.patch import form_patch

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda")
ap.add_argument("--rows", type=int, default=15)
ap.add_argument("--tiny", action="store_true", help="a 2-layer llama (checks the script on a CPU)")
a = ap.parse_args()
dev = torch.device(a.device)
cfg = dict(SMOLLM2_135M_CONFIG)
if a.tiny:
    cfg.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
backend = HFBackend(random_llama(cfg, dtype=torch.float32, device=dev).eval(), None, root_ids=[1, 5, 9, 13],
                    name="random-smollm2-arch")
cuda = dev.type == "cuda"
sync = torch.cuda.synchronize if cuda else (lambda: None)
g = torch.Generator().manual_seed(0)


def ids(n):
    return torch.randint(10, 40000, (n,), generator=g).tolist()


ctx = backend.encode(token_ids=ids(256))
b = backend.encode(token_ids=ids(256))
x64, x2048 = ids(64), ids(2048)
steps = {
    "encode 64 tokens": lambda: backend.encode(token_ids=x64),
    "encode 2,048 tokens": lambda: backend.encode(token_ids=x2048),
    "form_patch 256 on 256 (rank 32)": lambda: form_patch(backend, b, [ctx], rank=32),
}
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
for name, fn in steps.items():
    fn(), fn()  # warm
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    wall = time.perf_counter() - t0
    with profile(activities=acts) as prof:
        fn()
        sync()
    events = prof.key_averages()
    dev_total = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
    print(f"\n=== {name}: wall {wall * 1e3:.1f} ms, kernels' device time {dev_total * 1e3:.1f} ms")
    print(events.table(sort_by="self_cpu_time_total", row_limit=a.rows, max_name_column_width=60))
    if cuda:
        print(events.table(sort_by="self_cuda_time_total", row_limit=a.rows, max_name_column_width=60))
