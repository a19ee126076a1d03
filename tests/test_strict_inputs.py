"""Issue 10 item 6: every public entry point validates its arguments. A Hypothesis test drives the
public API with arbitrary arguments: every exception is a package error (``ContextDequeError``;
type mistakes are ``TypeError``s, value mistakes ``ValueError``s) and the window is unchanged
after it. Plus the issue's reproducers, one by one."""

from __future__ import annotations


import pytest
import torch
from helpers import micro_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contextdeque.core.errors import ArgumentTypeError, ContextDequeError
from contextdeque.core.operator import apply, relocate
from contextdeque.model.hf import HFBackend
from contextdeque.patch import form_patch
from contextdeque.stores import HostTier, MemoryTier, TieredStore
from contextdeque.window import ChunkRef, ContextWindow

A, B, C = [5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    return HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-strict-llama")


@pytest.fixture(scope="module")
def shared_store():
    return TieredStore([MemoryTier("cpu", None, name="device"), HostTier(None, name="host")])


def observe(win: ContextWindow):
    return (win.refs, win.evicted_refs, win.placement(), win.generation, win.tokens_used, win.closed,
            tuple(r.label for r in win.refs))


def build(backend, store):
    win = ContextWindow(backend, rank=2, store=store)
    refs = [win.append(token_ids=x) for x in (A, B, C)]
    win.evict(refs[1])
    return win, refs


STRANGER = ChunkRef(key=10**9, chunk_id="x" * 32, n_tokens=3)

junk = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6), st.binary(max_size=4),
    st.lists(st.one_of(st.integers(-5, 300), st.text(max_size=2), st.floats(-3, 3)), max_size=4),
    st.sampled_from([
        torch.tensor([1.5, 2.5]), torch.tensor([[5, 6], [7, 8]]), torch.zeros(3, 7), torch.zeros(0, dtype=torch.long),
        torch.tensor([5, 6, 7]), torch.tensor(True), {"a": 1}, (), STRANGER, object(), "full", -1, 0, 1, 2, 10**6,
        float("nan"), [5, 6], [[5, 6]], torch.float16, "float16", "slide", "error", "keep", "flag",
    ]),
)
# a mix of right and wrong values: some calls succeed, the rest must fail cleanly
maybe_ref = st.one_of(st.sampled_from(["ref0", "ref1", "ref2"]), junk)


def resolve(v, refs):
    if isinstance(v, str) and v in ("ref0", "ref1", "ref2"):
        return refs[int(v[-1])]
    if isinstance(v, list):
        return [resolve(x, refs) for x in v]
    return v


OPS = {
    "append": st.fixed_dictionaries({}, optional={
        "text": junk, "token_ids": junk, "embeds": junk, "chunk": junk, "label": junk, "span": junk,
        "modality": junk, "rel_positions": junk}),
    "append_pos": st.fixed_dictionaries({"_": junk}),
    "slide": st.fixed_dictionaries({"n": junk}),
    "evict": st.fixed_dictionaries({"ref": maybe_ref}),
    "recall": st.fixed_dictionaries({"ref": maybe_ref}, optional={"at": junk}),
    "purge": st.fixed_dictionaries({"ref": maybe_ref}),
    "reorder": st.fixed_dictionaries({"order": st.one_of(junk, st.lists(maybe_ref, max_size=4))}),
    "refresh": st.fixed_dictionaries({"refs": st.one_of(junk, st.lists(maybe_ref, max_size=3))}),
    "extend": st.fixed_dictionaries({"items": st.one_of(junk, st.lists(st.one_of(junk, st.fixed_dictionaries(
        {"token_ids": junk}, optional={"label": junk})), max_size=2))}, optional={"workers": junk, "overlap": junk}),
    "generate": st.fixed_dictionaries({"query": junk}, optional={"max_new_tokens": junk}),
    "input_ids_for": st.fixed_dictionaries({"query": junk}),
    "is_disposable": st.fixed_dictionaries({"ref": maybe_ref, "query": junk}, optional={"max_new_tokens": junk, "kl_tol": junk}),
    "heal": st.fixed_dictionaries({}, optional={"max_ms": junk, "max_steps": junk}),
}


def call(win, refs, op, kw):
    kw = {k: resolve(v, refs) for k, v in kw.items()}
    if op == "append_pos":
        return win.append(kw["_"])
    if op == "generate" and "max_new_tokens" not in kw:
        kw["max_new_tokens"] = 1
    if op == "generate":
        kw["chat"] = False
    if op == "is_disposable":
        kw.setdefault("max_new_tokens", 1)
        if isinstance(kw["max_new_tokens"], int) and kw["max_new_tokens"] > 4:
            kw["max_new_tokens"] = 4
    if op == "generate" and isinstance(kw["max_new_tokens"], int) and 4 < kw["max_new_tokens"] < 400:
        kw["max_new_tokens"] = 4  # keep decodes short; huge values still reach the position check
    return getattr(win, op)(**kw)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_public_api_with_arbitrary_arguments(backend, shared_store, data):
    op = data.draw(st.sampled_from(sorted(OPS)), label="op")
    kw = data.draw(OPS[op], label="kwargs")
    win, refs = build(backend, shared_store)
    before = observe(win)
    try:
        call(win, refs, op, kw)
    except ContextDequeError as e:
        assert observe(win) == before, f"{op}({kw}) failed with {e!r} but changed the window"
        assert str(e)
    except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
        pytest.fail(f"{op}({kw}) raised a non-package {type(e).__name__}: {e}")
    finally:
        if not win.closed:
            win.close()


CONSTRUCTOR_ARGS = {
    "budget_tokens": junk, "rank": junk, "store": junk, "patch_policy": junk, "cascade_policy": junk,
    "overflow": junk, "storage": junk, "placement": junk, "fidelity_target": junk, "max_patch_fraction": junk,
    "root": junk, "kv_selection": junk, "beyond_trained": junk,
}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_constructors_with_arbitrary_arguments(backend, data):
    which = data.draw(st.sampled_from(["window", "tiered", "memory", "host", "tier_lookup"]), label="which")
    try:
        if which == "window":
            kw = data.draw(st.fixed_dictionaries({}, optional=CONSTRUCTOR_ARGS), label="kw")
            bk = data.draw(st.one_of(st.just(backend), junk), label="backend")
            ContextWindow(bk, **kw).close()
        elif which == "tiered":
            tiers = data.draw(st.one_of(junk, st.lists(st.one_of(junk, st.just("mem")), max_size=3)), label="tiers")
            if isinstance(tiers, list):
                tiers = [MemoryTier("cpu", None, name="m") if t == "mem" else t for t in tiers]
            TieredStore(tiers, write_through=data.draw(st.one_of(st.booleans(), junk), label="wt"))
        elif which == "memory":
            MemoryTier(data.draw(st.one_of(st.just("cpu"), junk), label="device"), data.draw(junk, label="budget"),
                       name=data.draw(st.one_of(st.just("m"), junk), label="name"))
        elif which == "host":
            HostTier(data.draw(junk, label="budget"))
        else:
            TieredStore([MemoryTier("cpu", None, name="m")]).tier(data.draw(junk, label="name"))
    except ContextDequeError as e:
        assert str(e)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{which} raised a non-package {type(e).__name__}: {e}")


# ---------------------------------------------------------------- the issue's reproducers
@pytest.mark.parametrize(
    "make, kind, name",
    [
        (lambda b: ContextWindow(b, budget_tokens="abc"), TypeError, "budget_tokens"),
        (lambda b: ContextWindow(b, rank=None), TypeError, "rank"),
        (lambda b: ContextWindow(b, store=42), TypeError, "store"),
        (lambda b: ContextWindow(None), TypeError, "backend"),
        (lambda b: ContextWindow(b, budget_tokens=-3), ValueError, "budget_tokens"),
        (lambda b: TieredStore([]), ValueError, "tiers"),
        (lambda b: TieredStore([MemoryTier("cpu", None, name="x"), HostTier(None, name="x")]), ValueError, "unique"),
        (lambda b: MemoryTier("cpu", -5), ValueError, "budget_bytes"),
        (lambda b: TieredStore([MemoryTier("cpu", None)]).tier("x"), KeyError, "'x'"),
        (lambda b: MemoryTier("cuda:7", None), ValueError, "cuda:7"),
    ],
)
def test_constructor_reproducers(backend, make, kind, name):
    with pytest.raises(ContextDequeError) as exc:
        make(backend)
    assert isinstance(exc.value, kind)
    assert name in str(exc.value)


def test_operation_reproducers(backend, shared_store):
    win, refs = build(backend, shared_store)
    before = observe(win)
    for call_it, kind, name in [
        (lambda: win.reorder(None), TypeError, "order"),
        (lambda: win.generate(None), TypeError, "query"),
        (lambda: win.generate([5, 6], max_new_tokens=0), ValueError, "max_new_tokens"),
        (lambda: win.evict("ref"), TypeError, "ref"),
        (lambda: win.slide(1.5), TypeError, "n"),
        (lambda: win.recall(refs[1], at="0"), TypeError, "at"),
    ]:
        with pytest.raises(ContextDequeError) as exc:
            call_it()
        assert isinstance(exc.value, kind), (name, type(exc.value))
        assert name in str(exc.value)
        assert observe(win) == before
    chunk = win.chunk(refs[0])
    with pytest.raises(ArgumentTypeError, match="antecedents"):
        form_patch(backend, chunk, antecedents=chunk)
    with pytest.raises(ArgumentTypeError, match="chunk"):
        relocate(None, 5)
    with pytest.raises(ArgumentTypeError, match="patch"):
        apply(chunk, 5, patch="x")


@pytest.mark.parametrize(
    "kwargs, kind",
    [({"token_ids": [1.5, 2.5]}, TypeError), ({"token_ids": [5, 10_000]}, ValueError), ({"text": 5}, TypeError),
     ({"embeds": torch.zeros(3, 7)}, ValueError), ({"token_ids": ["a"]}, TypeError)],
)
def test_backend_encode_checks_its_inputs(backend, kwargs, kind):
    with pytest.raises(ContextDequeError) as exc:
        backend.encode(**kwargs)
    assert isinstance(exc.value, kind) and next(iter(kwargs)) in str(exc.value)
