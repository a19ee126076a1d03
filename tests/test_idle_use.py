"""What idle-time anticipation forms that no step uses (replay.idle_use): the anticipating run's
work beyond the heal's, the anticipated patches formed and the placements served from them."""

from __future__ import annotations

import pytest
from helpers import micro_llama

from contextdeque.model.hf import HFBackend
from contextdeque.replay.idle_use import idle_use_table
from contextdeque.traces import generate


@pytest.fixture(scope="module")
def backend(one_thread):
    return HFBackend(micro_llama(11), None, root_ids=[1, 3], name="tiny-idle-use-llama")


def test_idle_use_counts_what_anticipation_formed_and_served(backend):
    trace = generate("web", seed=0, steps=12)
    off, on = idle_use_table(backend, [trace], window_options={"beyond_trained": True})
    assert (off.anticipate, on.anticipate) == (False, True)
    assert off.served == 0 and not off.formed and off.hit_rate == 0.0
    assert on.served > 0 and sum(on.formed.values()) > 0 and on.hit_rate > off.hit_rate
    assert on.forwards > off.forwards  # idle work: what a later heal did not need anyway


def test_window_bench_idle_use_cli(capsys, one_thread):
    """``window-bench --idle-use`` end to end on a tiny model: one row per trace and setting."""
    import json

    from contextdeque.cli import main

    assert main(["window-bench", "--model", "tiny", "--threads", "1", "--idle-use", "video", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["idle_use"]
    assert [(r["trace"], r["anticipate"]) for r in rows] == [("video-0", False), ("video-0", True)]
    assert rows[1]["forwards"] > rows[0]["forwards"] and rows[1]["served"] > 0
