"""The vLLM connector's runtime counters (``integrations/stats.py``): the scheduler thread and the
loading thread both count, under the one lock, so no update is lost (tested without vLLM)."""

from __future__ import annotations

import threading
import time

from contextdeque.integrations.stats import RuntimeStats


class _SlowWrites(RuntimeStats):
    """Every write waits a moment first: two unlocked ``+=`` would read the same old value."""

    def __setitem__(self, key, value):
        time.sleep(1e-5)
        super().__setitem__(key, value)


def test_counts_from_two_threads_are_never_lost():
    stats = _SlowWrites()
    n = 300

    def count(field):
        for _ in range(n):
            stats.count(loads=1, **{field: 2.0})

    threads = [threading.Thread(target=count, args=(f,)) for f in ("match_ms", "load_layers_ms")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert dict(stats) == {"loads": 2 * n, "match_ms": 2.0 * n, "load_layers_ms": 2.0 * n}


def test_count_max_and_reads():
    stats = RuntimeStats()
    assert stats["never_counted"] == 0.0
    stats.count_max("root_check_max_rel_err", 3e-6)
    stats.count_max("root_check_max_rel_err", 1e-6)
    assert stats["root_check_max_rel_err"] == 3e-6
