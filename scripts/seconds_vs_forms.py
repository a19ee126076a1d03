"""The placement scheduler priced in seconds (SECONDS_WEIGHTS, the default) against priced in forms
(FORMS_WEIGHTS) and arrival order: seeds 0-15 of each generated kind, without a budget / at 6,000 /
at 3,000 tokens, the patch arm's estimated seconds summed per kind (docs/replay.md, "Priced in
seconds"). Usage: OMP_NUM_THREADS=1 python scripts/seconds_vs_forms.py [web video doc]"""
import sys

from contextdeque.replay import ReplayConfig, Replayer
from contextdeque.scheduler import FORMS_WEIGHTS, SECONDS_WEIGHTS, SchedulerPlacement
from contextdeque.scheduler.cost_model import CostModel
from contextdeque.traces import generate

for kind in sys.argv[1:] or ["web", "video", "doc"]:
    traces = [generate(kind, seed=s) for s in range(16)]
    row = {}
    for name, make in (("seconds", lambda: SchedulerPlacement(weights=SECONDS_WEIGHTS)),
                       ("forms", lambda: SchedulerPlacement(weights=FORMS_WEIGHTS)), ("arrival", lambda: "arrival")):
        row[name] = [round(sum(Replayer(t, make(), "lru", "patch", CostModel(), ReplayConfig(budget_tokens=b)).run().est_seconds
                               for t in traces)) for b in (None, 6000, 3000)]
    print(kind, row, flush=True)
