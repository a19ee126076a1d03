"""torch's thread count: the one choice (contextdeque.model.threads) from free cores, load and
model size, its overrides in order, and every command's --threads."""

from __future__ import annotations

import pytest
import torch

from contextdeque.core.errors import ArgumentError
from contextdeque.model import threads
from contextdeque.model.threads import THREADS_ENV, apply_threads, choose_threads, parse_threads


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_settled", None)
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_auto_takes_the_free_cores_capped_by_the_model_size():
    big = 10 * threads.PARAMS_PER_THREAD * 16
    assert choose_threads(cores=16, load=0.2, model_params=big).threads == 16
    assert choose_threads(cores=16, load=10.0, model_params=big).threads == 6  # 10 of 16 busy
    assert choose_threads(cores=2, load=12.0, model_params=big).threads == 1  # a busy shared machine
    assert choose_threads(cores=2, load=0.6, model_params=big).threads == 1  # rounds to the nearest core
    assert choose_threads(cores=16, load=0.0, model_params=135_000_000).threads == 2  # SmolLM2-135M
    assert choose_threads(cores=16, load=0.0, model_params=1).threads == 1  # a tiny model
    assert choose_threads(cores=4, load=0.0).threads == 4  # no model size: the free cores


def test_overrides_in_order(monkeypatch):
    assert choose_threads(3, cores=16, load=0.0) == threads.ThreadChoice(3, "asked")
    assert choose_threads("auto", cores=16, load=0.0, model_params=1).threads == 1
    assert choose_threads(0).threads is None and choose_threads("torch").threads is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads(cores=16, load=0.0).threads is None  # torch honours OMP_NUM_THREADS
    monkeypatch.setenv(THREADS_ENV, "5")
    assert choose_threads(cores=16, load=0.0) == threads.ThreadChoice(5, f"${THREADS_ENV}")
    assert choose_threads(2).threads == 2  # an explicit count beats the environment
    monkeypatch.setenv(THREADS_ENV, "lots")
    with pytest.raises(ArgumentError, match=THREADS_ENV):
        choose_threads()
    for bad in (-1, "x", 1.5, True):
        with pytest.raises(ArgumentError):
            parse_threads(bad, "threads")


def test_the_automatic_choice_is_settled_once_an_explicit_one_always_applies(monkeypatch):
    apply_threads(1)
    assert torch.get_num_threads() == 1
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    assert apply_threads(None, model_params=10**12).threads == 1  # a later load keeps the choice made
    assert torch.get_num_threads() == 1
    apply_threads(2)
    assert torch.get_num_threads() == 2


def test_available_cores_reads_affinity_and_the_cgroup_quota(tmp_path, monkeypatch):
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(threads, "_CGROUP_V2_MAX", cpu_max)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _pid: set(range(8)))
    cpu_max.write_text("max 100000\n")
    assert threads.available_cores() == 8
    cpu_max.write_text("250000 100000\n")  # 2.5 cores of quota
    assert threads.available_cores() == 2
    cpu_max.write_text("50000 100000\n")
    assert threads.available_cores() == 1


def test_every_model_command_takes_the_one_threads_option(capsys):
    from contextdeque.cli import COMMANDS, build_parser

    without = {"loadtest", "traces", "replay-bench"}  # no model of their own
    for name in set(COMMANDS) - without:
        args = build_parser(name).parse_args([name, "--threads", "auto"] + (["x.jsonl"] if name == "replay" else []))
        assert args.threads is None, name
        assert build_parser(name).parse_args([name, "--threads", "3"] + (["x.jsonl"] if name == "replay" else [])).threads == 3
        with pytest.raises(SystemExit):
            build_parser(name).parse_args([name, "--threads", "-2"])
    capsys.readouterr()


def test_thread_bench_window_operations_count_their_work(tiny_backend_factory):
    """The measurement behind the default: each operation timed, healing forms the reordered
    pages' patches, generation makes its tokens (timings are printed, never thresholds)."""
    from contextdeque.eval.thread_bench import run_window_ops

    r = run_window_ops(tiny_backend_factory("llama"), pages=3, page_tokens=16, new_tokens=3, rank=4)
    assert r["append_forwards"] >= 3 and r["heal_forwards"] >= 2 and r["generated_tokens"] == 3
    assert min(r["append_s"], r["heal_s"], r["generate_s"]) > 0 and r["threads"] == torch.get_num_threads()
