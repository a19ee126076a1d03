"""Two `contextdeque serve` replicas (separate processes, separate ports) sharing one Valkey
(a single server and a 3-node cluster): what A encoded, B serves with zero encode forwards;
an entry planted by a writer without the secret is never used; wrong AUTH is refused."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest
import torch

from contextdeque.stores import StoreEntry, ValkeyTier
from serve_util import ServeProcess, metric
from valkey_util import Server

SECRET = "replica-test-secret-0123456789abcdef"
ENV = {"CONTEXTDEQUE_STORE_SECRET": SECRET}

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "The courier's name is Ilse Marrow. She carries a parcel to the lighthouse."},
    {"role": "assistant", "content": "Noted."},
    {"role": "user", "content": "Who carries the parcel, and where to?"},
]


def ask(server: ServeProcess, model: str, messages=CONVERSATION, session: str | None = None):
    headers = {"X-Session-Id": session} if session else None
    r = server.client().chat.completions.create(model=model, messages=messages, max_tokens=16, extra_headers=headers)
    return r.choices[0].message.content, r.usage.model_extra["contextdeque"]


def model_name(server: ServeProcess) -> str:
    return httpx.get(server.url + "/healthz").json()["model"]


def test_default_model_replica_b_serves_what_a_encoded_with_zero_encodes(valkey_single) -> None:
    trust = "r" + uuid.uuid4().hex[:8]  # a fresh keyspace on the shared session server
    args = ("--store", valkey_single.url, "--trust-domain", trust, "--patch-policy", "eager")  # encodes/patches per request
    a, b = ServeProcess(*args, env=ENV).launch(), ServeProcess(*args, env=ENV).launch()  # load in parallel
    with a.wait_ready(), b.wait_ready():
        name = model_name(a)
        text_a, ua = ask(a, name)
        assert ua["encodes"] == 3  # user, assistant, user (the system prompt is the root)
        text_b, ub = ask(b, name)
        assert ub["encodes"] == 0 and ub["patches_formed"] == 0 and ub["patches_reused"] >= 1
        assert text_b == text_a
        mb = b.metrics()
        assert metric(mb, "contextdeque_encode_forwards_total") == 0
        assert metric(mb, "contextdeque_patch_forwards_total") == 0
        assert metric(mb, "contextdeque_store_lookups_total", kind="chunk", tier="valkey") == 3
        assert metric(mb, "contextdeque_valkey_rejected_total") == 0
        assert metric(a.metrics(), "contextdeque_encode_forwards_total") == 3
        h = httpx.get(b.url + "/healthz").json()
        assert h["store"][-1]["kind"] == "valkey" and h["store"][-1]["available"] and "signed" in h["store"][-1]["trust"]


def test_cluster_replicas_share_too(valkey_cluster3) -> None:
    args = ("--model", "tiny:llama", "--store", valkey_cluster3.url, "--trust-domain", "c" + uuid.uuid4().hex[:8],
            "--patch-policy", "eager")
    with ServeProcess(*args, env=ENV) as a, ServeProcess(*args, env=ENV) as b:
        text_a, ua = ask(a, "tiny-llama")
        text_b, ub = ask(b, "tiny-llama")
        assert ua["encodes"] == 3 and ub["encodes"] == 0 and ub["patches_formed"] == 0 and text_a == text_b
        mb = b.metrics()
        assert metric(mb, "contextdeque_encode_forwards_total") == 0
        # B's session holds leases on what its window holds (3 chunks and their patches)
        assert metric(mb, "contextdeque_valkey_leases") >= 3


def test_planted_unsigned_entries_are_never_used(valkey_single) -> None:
    trust = "p" + uuid.uuid4().hex[:8]
    args = ("--model", "tiny:llama", "--store", valkey_single.url, "--trust-domain", trust, "--patch-policy", "eager")
    with ServeProcess(*args, env=ENV) as a:
        text_a, _ = ask(a, "tiny-llama")
        fingerprint = httpx.get(a.url + "/healthz").json()["fingerprint"]
    signed = ValkeyTier(valkey_single.url, namespace=fingerprint, trust_domain=trust, secret=SECRET)
    rogue = ValkeyTier(valkey_single.url, namespace=fingerprint, trust_domain=trust)  # no secret
    chunks = [k for k in signed.keys() if k.startswith("chunk/")]
    assert len(chunks) == 3
    for k in chunks:  # well-formed entries with poisoned KV, same metadata, same keys
        e = signed.get(k)
        poisoned = {n: (t + 0.5 * torch.randn_like(t) if t.is_floating_point() else t) for n, t in e.tensors.items()}
        rogue.put(k, StoreEntry(poisoned, dict(e.meta)), overwrite=True)
    assert all(signed.get(k) is None for k in chunks)
    with ServeProcess(*args, env=ENV) as b:
        text_b, ub = ask(b, "tiny-llama")
        assert text_b == text_a and ub["encodes"] == 3  # recomputed, never the plant
        mb = b.metrics()
        assert metric(mb, "contextdeque_valkey_rejected_total") >= 3
        assert metric(mb, "contextdeque_valkey_corrupt_total") == 0
    assert all(signed.get(k) is not None for k in chunks)  # B's recomputed entries replaced the plants


def test_wrong_valkey_auth_refuses_to_start_and_logs_no_secret(tmp_path: Path) -> None:
    pw = "valkey-pw-" + uuid.uuid4().hex
    srv = Server(tmp_path / "auth").start()
    srv.client().config_set("requirepass", pw)
    try:
        for url, env in ((f"valkey://:wrong-{pw[-6:]}@127.0.0.1:{srv.port}/0", ENV),
                         (srv.url, {**ENV, "CONTEXTDEQUE_STORE_PASSWORD": "not-" + pw})):
            p = ServeProcess("--model", "tiny:llama", "--store", url, env=env)
            with pytest.raises(RuntimeError, match="did not start"):
                p.start()
            assert p.wait_exit() == 2
            assert "StoreAuthError" in p.log and "refused the credentials" in p.log
            assert pw not in p.log and SECRET not in p.log and pw[-6:] not in p.log
        ok = ServeProcess("--model", "tiny:llama", "--store", srv.url, env={**ENV, "CONTEXTDEQUE_STORE_PASSWORD": pw}).start()
        try:
            assert httpx.get(ok.url + "/healthz").json()["store"][-1]["available"]
            assert pw not in ok.log and SECRET not in ok.log
            # the password is rotated while serving: requests are still answered (locally), the
            # tier reports itself away for "auth", and no password reaches the log
            rotated = "rotated-" + uuid.uuid4().hex
            admin = srv.client(password=pw)
            admin.config_set("requirepass", rotated)
            admin = srv.client(password=rotated)
            admin.client_kill_filter(_type="normal", skipme=True)
            from serve_util import wait_until

            def away_for_auth() -> bool:
                r = ok.client().chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": uuid.uuid4().hex}], max_tokens=2)
                assert r.choices[0].message.content is not None
                h = httpx.get(ok.url + "/healthz").json()
                return h["status"] == "degraded" and h["store"][-1]["away_reason"] == "auth"

            assert wait_until(away_for_auth, 60, step=0.5)
            assert metric(ok.metrics(), "contextdeque_valkey_fallbacks_total", reason="auth", tier="valkey") >= 1
            assert pw not in ok.log and rotated not in ok.log and SECRET not in ok.log
        finally:
            ok.stop()
    finally:
        srv.stop()


def test_latency_first_replica_heals_in_idle_time_and_b_reuses_what_it_healed(valkey_single) -> None:
    """``--patch-policy latency-shared`` (the server's default): A's request runs no patch forward
    (the new messages get one prefix-cache-style forward each); A heals once idle and the
    canonicals and patches it computed reach Valkey, so B then serves the conversation with no
    forward at all. (Under ``latency`` a message read where it arrived never gets a canonical, so
    there would be nothing for B to reuse.)"""
    from serve_util import wait_until

    trust = "l" + uuid.uuid4().hex[:8]
    args = ("--model", "tiny:llama", "--store", valkey_single.url, "--trust-domain", trust, "--patch-policy", "latency-shared")
    a, b = ServeProcess(*args, env=ENV).launch(), ServeProcess(*args, "--no-heal", env=ENV).launch()
    with a.wait_ready(), b.wait_ready():
        _, ua = ask(a, "tiny-llama")
        assert ua["patches_formed"] == 0  # nothing formed on the request path
        assert wait_until(lambda: metric(a.metrics(), "contextdeque_heal_pending_chunks") == 0, 300)
        ma = a.metrics()
        assert metric(ma, "contextdeque_heal_steps_total") >= 1 and metric(ma, "contextdeque_heal_encodes_total") >= 1
        assert metric(ma, "contextdeque_heal_tokens_prefilled_total") > 0
        text_b, ub = ask(b, "tiny-llama")
        assert ub["encodes"] == 0 and ub["patches_formed"] == 0 and ub["patches_reused"] >= 1
        mb = b.metrics()
        assert metric(mb, "contextdeque_encode_forwards_total") == 0 and metric(mb, "contextdeque_patch_forwards_total") == 0
        assert metric(mb, "contextdeque_heal_pending_chunks") == 0  # nothing left to heal: B got the healed state
        # A rebuilt from the store (a new session) builds the same window: the same greedy reply
        text_a2, ua2 = ask(a, "tiny-llama", session="again")
        assert ua2["encodes"] == 0 and text_a2 == text_b
