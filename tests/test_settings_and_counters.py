"""One settings object passed down (``WindowConfig``: CLI, serve, MessageWindow, sessions) and one
counts type every cost record aggregates (``core/counters.py``)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from contextdeque.core.counters import Counters, Tally, adds, shown
from contextdeque.core.errors import WindowError, WindowTypeError
from contextdeque.stores import TierTraffic
from contextdeque.window import DEFAULT_RANK, WindowConfig
from contextdeque.window.receipt import Receipt

# what Receipt.as_dict wrote before it was generic (its serialized names must stay)
RECEIPT_KEYS = {
    "op", "forwards", "tokens_prefilled", "encodes", "patches_formed", "patches_reused", "pages_written",
    "bytes_moved", "wall_ms", "refs", "left", "cascade", "deferred", "notes", "fallbacks", "load_fallbacks",
    "loading", "repairs", "served", "fidelity_misses", "placed", "budget",
}


def test_a_new_count_is_one_field_summed_and_written_without_listing_it():
    @dataclasses.dataclass
    class Work(Counters):
        label: str = shown(default="")
        pages: int = adds()
        per_tier: dict = adds(dict)
        notes: tuple = adds(())
        wall_ms: float = adds(0.0, json=lambda v: round(v, 1))

    a = Work(label="a", forwards=1, pages=2, per_tier={"host": 3}, notes=("x",), wall_ms=1.04)
    b = Work(label="b", forwards=2, encodes=1, per_tier={"host": 1, "disk": 5}, notes=("y",), wall_ms=2.0)
    total = a + b
    assert (total.label, total.forwards, total.encodes, total.pages) == ("a", 3, 1, 2)
    assert total.per_tier == {"host": 4, "disk": 5} and a.per_tier == {"host": 3}  # a is not changed
    assert total.notes == ("x", "y") and total.as_dict()["wall_ms"] == 3.0
    assert set(total.as_dict()) == {f.name for f in dataclasses.fields(Work)}
    # records of different types aggregate into the shared counts
    summed = Counters.summed([a, Receipt("append", forwards=4, tokens_prefilled=9)])
    assert summed.counts() == dict(forwards=5, tokens_prefilled=9, encodes=0, patches_formed=0, patches_reused=0)


def test_receipts_keep_their_serialized_names_and_sum_generically():
    a = Receipt("append", forwards=1, tokens_prefilled=5, bytes_moved={"device": 3}, wall_ms=1.23456)
    b = Receipt("recall", forwards=2, patches_reused=1, bytes_moved={"host": 2}, repairs=("r",))
    d = (a + b).as_dict()
    assert set(d) == RECEIPT_KEYS and d["op"] == "append" and d["wall_ms"] == round(1.23456, 3)
    assert (d["forwards"], d["tokens_prefilled"], d["patches_reused"]) == (3, 5, 1)
    assert d["bytes_moved"] == {"device": 3, "host": 2} and d["repairs"] == ["r"]


def test_tier_traffic_adds_counts_keeps_the_latest_reason_and_who_served():
    a = TierTraffic()
    a.add_read("host", 10)
    a.add_fallback("valkey", "timeout")
    b = TierTraffic()
    b.add_miss()
    b.add_written("disk", 5)
    b.add_fallback("valkey", "auth")
    total = TierTraffic.summed([a, b])
    assert total.fallbacks == {"valkey": 2} and total.fallback_reasons == {"valkey": "auth"}
    assert total.served_from is None and total.misses == 1 and total.as_dict()["moved_bytes"] == 15
    a.merge(b)
    assert a.as_dict() == total.as_dict()


def test_arm_and_replay_records_write_what_they_wrote_before():
    from contextdeque.eval.arms.base import ArmReport
    from contextdeque.replay.pool import ReplayResult

    arm = ArmReport(arm="x", chunk_tokens=10, num_layers=2, page_bytes=100, forwards=1, tokens_prefilled=3,
                    extras={"k": 1})
    assert set(arm.as_dict()) == {"arm", "forwards", "compile_forwards", "tokens_prefilled", "token_layers",
                                  "tokens_recomputed", "chunk_tokens", "recompute_fraction", "bytes_canonical",
                                  "bytes_extra", "bytes_stored", "bytes_fraction", "k"}
    res = ReplayResult(trace="t", placement="p", eviction="e", arm="a", est_seconds=1.23456789)
    out = res.as_dict()
    assert "patches_formed" not in out and out["est_seconds"] == 1.234568 and isinstance(res, Counters)
    assert issubclass(ArmReport, Tally)


def test_window_options_build_one_config_validated_once():
    from contextdeque.cli.window_options import add_fidelity_target_arguments, add_window_arguments, window_config

    parser = argparse.ArgumentParser()
    add_window_arguments(parser)
    add_fidelity_target_arguments(parser, "η")
    args = parser.parse_args(["--policy", "eager", "--rank", "8", "--fidelity-target", "0.9"])
    config = window_config(args, budget_tokens=64)
    assert (config.patch_policy, config.rank, config.fidelity_target, config.budget_tokens) == ("eager", 8, 0.9, 64)
    assert parser.parse_args([]).rank == DEFAULT_RANK and parser.parse_args([]).patch_policy == "default"
    for bad in (["--rank", "-1"], ["--patch-policy", "no-such-policy"]):
        with pytest.raises(WindowError):
            window_config(parser.parse_args(bad))


def test_serve_and_message_windows_take_the_config_as_given():
    from contextdeque.serve.engine import SERVE_POLICY, serve_config
    from contextdeque.session import MessageWindow

    config = serve_config(rank=4)
    assert (config.patch_policy, config.rank, config.overflow) == (SERVE_POLICY, 4, "error")
    with pytest.raises(WindowTypeError):  # checked before the backend is touched
        MessageWindow(None, {"rank": 4})  # type: ignore[arg-type]
    with pytest.raises(WindowError):  # a MessageWindow keeps the whole list
        MessageWindow(None, WindowConfig(overflow="slide"))
    with pytest.raises(WindowError):
        WindowConfig(patch_policy="no-such-policy")


def test_window_bench_rows_backend_and_family_counters_are_counters():
    """``StepRow`` (window-bench's per-step rows), the backend's counts and a window family's own
    counts are :class:`Counters`: they add generically and write the names they wrote before."""
    from contextdeque.eval.step_bench import StepRow
    from contextdeque.window.context import FamilyCounters

    a = StepRow(policy="eager", step="slide", forwards=2, tokens_prefilled=7, encodes=1, heal_forwards=1,
                kl_answer=0.12345678, kl_vs_eager=None, ttft_ms=2.0, reprefill_ms=3.0, prefix_cache_ms=1.0)
    b = StepRow(policy="latency", step="slide", forwards=1, tokens_prefilled=3, deferred=2)
    d = (a + b).as_dict()
    assert set(d) == {"policy", "step", "forwards", "step_ms", "ttft_ms", "reprefill_ms", "prefix_cache_ms",
                      "kl_answer", "kl_healed", "heal_ms", "heal_forwards", "kl_vs_eager", "deferred", "page_mb",
                      "floor_ms", "served", "placed", "idle", "tokens", "ttft_vs_reprefill", "ttft_vs_prefix_cache"}
    assert (d["policy"], d["forwards"], d["heal_forwards"], d["deferred"]) == ("eager", 3, 1, 2)
    assert d["kl_answer"] == 0.123457 and d["ttft_vs_reprefill"] == 1.5 and d["kl_vs_eager"] is None
    assert (a + b).counts()["tokens_prefilled"] == 10 and isinstance(a, Counters)

    fam = FamilyCounters(encodes=2, decode_forwards=3)
    fam += FamilyCounters(encodes=1, vision_encodes=1)
    assert fam.as_dict() == {"encodes": 3, "decode_forwards": 3, "decode_tokens": 0, "vision_encodes": 1}


def test_backend_counts_every_forward_in_its_counters(tiny_backend_factory, one_thread):
    """The backend's ``forwards_run`` / ``tokens_prefilled`` are its :class:`Counters`; a root view
    counts its own (from where the backend stood)."""
    backend = tiny_backend_factory("llama")
    before = dataclasses.replace(backend.counters)
    backend.forward(input_ids=[5, 6, 7], positions=backend.text_positions(0, 3), logits="none")
    assert (backend.counters.forwards - before.forwards, backend.tokens_prefilled - before.tokens_prefilled) == (1, 3)
    assert backend.forwards_run == backend.counters.forwards
    view = backend.with_root([9])
    view.count_forward(4)
    assert view.counters.forwards == backend.counters.forwards + 1 and view.tokens_prefilled == backend.tokens_prefilled + 4
