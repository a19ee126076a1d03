"""`ValkeyTier`: a store tier shared by processes on many machines, kept in Valkey.

Valkey (single server or cluster; any Redis-protocol server) is the distributed engine;
this file only maps the tier interface onto it.

Keys (``P`` = ``cdq1:<trust domain>:<namespace>:{<sha256 of the store key>}``; the braces
are a cluster hash tag, so every key of one entry lives in one slot):

- ``P:m``  the *manifest*: JSON naming the entry's parts, the sha256 of their concatenation,
  the entry's metadata and priority, and (with a secret) an HMAC signature. Written last,
  so a reader never sees a half-written entry: the parts it names are complete.
- ``P:p:<blob digest>:<i>``  part ``i`` of the entry's bytes: the same checksummed
  safetensors framing as the disk tier (`contextdeque.stores.format`), split into parts of
  ``part_bytes`` (large values are Valkey's slow path). Parts are content-named, so two
  writers of one entry never mix halves, and are written with a short expiry that the
  manifest write lifts: a writer dying mid-way leaves nothing behind for long.
- ``P:l``  leases (a sorted set: holder -> expiry in ms): `pin` as a lease that its holder
  renews while it lives; a lease keeps an entry with a TTL from expiring before the lease ends.

What can go wrong, and what a reader makes of it:

- the server evicted the manifest or a part (``maxmemory`` policy) or it expired: a *miss*
  (counted in ``stats.evicted``), never corruption; the dangling manifest is removed;
- the bytes fail the sha256 in the manifest or the format's checksums: `CorruptEntryError`
  (``corrupt_ok``: dropped and a miss), counted in ``stats.corrupt``;
- with a ``secret``, an entry whose signature does not verify under this trust domain's
  secret (written by someone without it) is *never used*: a miss, counted in
  ``stats.rejected``; the caller recomputes and its put replaces the bad entry. Without a
  secret the tier trusts every writer of the server and says so (``trust``, the log, repr);
- the server is unreachable, times out or is loading: reads are misses, writes raise
  `StoreUnavailableError` (a `TieredStore` keeps the entry in its local tiers), each
  reported into the running operation's `TierTraffic.fallbacks` and ``stats.fallbacks``.
  After a failure the tier waits ``retry_after_s`` before trying the server again (so a
  dead server costs one timeout, not one per operation); when it answers, sharing resumes.

Credentials (password, ACL user) and the secret are never logged, never in ``repr`` or
error messages (`StoreAuthError` names the endpoint and the user only).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from contextdeque.core.errors import (
    CollisionError,
    CorruptEntryError,
    StoreCapacityError,
    StoreConfigError,
    StoreUnavailableError,
)
from contextdeque.stores.base import Expect, PutRequest, PutResult, StoreEntry, Tier, check_collision, check_key
from contextdeque.stores.format import decode_entry, encode_entry
from contextdeque.stores.valkey_link import Away, ValkeyEndpoint, ValkeyLink, ValkeyStats, redact_url

log = logging.getLogger("contextdeque.stores.valkey")

__all__ = ["DEFAULT_PART_BYTES", "MANIFEST_VERSION", "ValkeyEndpoint", "ValkeyStats", "ValkeyTier", "redact_url"]

MANIFEST_VERSION = 1
DEFAULT_PART_BYTES = 4 * 1024 * 1024
_ORPHAN_MS = 10 * 60 * 1000  # parts not yet named by a manifest expire after this
_REPLACED_MS = 30 * 1000  # parts of a replaced version: long enough for readers in flight
_SIG_DOMAIN = b"cdq-valkey-entry-v1\0"
_NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")

# compare-and-delete: drop a manifest only if it still is the one we judged (one key: one slot)
_DEL_IF_SAME = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end"


def _check_name(what: str, value: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 128 or not set(value) <= _NAME_OK:
        raise StoreConfigError(f"{what} must be 1-128 characters of [A-Za-z0-9._-], got {value!r}")
    return value


class _Rejected(Exception):
    """A manifest that must not be used (bad signature, unreadable under a secret)."""


class ValkeyTier(Tier):
    """Entries in a Valkey server or cluster, shared by every process that points at it.

    Capacity is the server's: ``maxmemory`` and its eviction policy decide what stays
    (an evicted entry reads as a miss). The tier's own ``budget_bytes`` is None.

    Args:
        url: ``valkey://[user[:password]@]host:port/db``; ``valkeys://`` for TLS;
            ``valkey+cluster://host:port`` for a cluster (see `ValkeyEndpoint`).
        namespace: keys are namespaced by this (a serving process passes its model
            fingerprint), [A-Za-z0-9._-].
        trust_domain: the signing domain: writers and readers of one domain share one
            secret; keys of different domains never meet.
        secret: HMAC-SHA256 key (bytes or str) signing every entry this tier writes and
            verifying every entry it reads. None: entries are unsigned and every writer
            of the server is trusted (``trust`` says so, and a warning is logged once).
        username / password: ACL user / password (``AUTH``); override the URL's.
        tls_ca_file / tls_cert_file / tls_key_file: CA bundle to verify the server, and a
            client certificate for mutual TLS. ``tls_verify=False`` skips verification
            (loopback tests only). Any of them implies TLS.
        part_bytes: size of the parts an entry is split into (a few MB is Valkey's fast path).
        ttl_s: expire entries this long after their last use (None: never; the server's
            maxmemory policy decides). Leases (`pin`) hold an entry past its TTL.
        lease_s: a pin is a lease of this length, renewed by a background thread every
            ``lease_s / 3`` while this tier holds it; a holder that dies lets it lapse.
        timeout_s: socket timeout per command; connect timeout is the same.
        retry_after_s: after the server failed, answer locally for this long before trying
            it again.
        name: tier name in `TierTraffic`.

    Raises:
        StoreConfigError: bad URL / options, or the TLS settings fail (certificate not
            trusted): configuration errors are loud, never a silent fallback.
        StoreAuthError: the server refused the credentials.
        ImportError: the ``valkey`` client package is missing (``pip install contextdeque[serve]``).

    An unreachable server at construction is *not* an error: the tier starts away and
    begins sharing when the server answers.
    """

    kind = "valkey"

    persistent = True
    remote = True
    shared = True

    def __init__(
        self,
        url: str = "valkey://127.0.0.1:6379/0",
        *,
        namespace: str = "shared",
        trust_domain: str = "default",
        secret: bytes | str | None = None,
        username: str | None = None,
        password: str | None = None,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        tls_verify: bool = True,
        part_bytes: int = DEFAULT_PART_BYTES,
        ttl_s: float | None = None,
        lease_s: float = 60.0,
        timeout_s: float = 5.0,
        retry_after_s: float = 1.0,
        name: str = "valkey",
    ) -> None:
        super().__init__(name=name, budget_bytes=None, policy="lru")
        ep = ValkeyEndpoint.parse(url)
        if username is not None or password is not None:
            ep = ValkeyEndpoint(
                ep.host, ep.port, ep.db, username if username is not None else ep.username,
                password if password is not None else ep.password, ep.tls, ep.cluster,
            )
        if any(x is not None for x in (tls_ca_file, tls_cert_file, tls_key_file)) or not tls_verify:
            ep = ValkeyEndpoint(ep.host, ep.port, ep.db, ep.username, ep.password, True, ep.cluster)
        self.endpoint = ep
        self.namespace = _check_name("namespace", namespace)
        self.trust_domain = _check_name("trust_domain", trust_domain)
        if secret is not None and not isinstance(secret, (bytes, str)):
            raise StoreConfigError(f"secret must be bytes or str, got {type(secret).__name__}")
        if secret is not None and len(secret) < 16:
            raise StoreConfigError("secret must be at least 16 bytes (use a random key per trust domain)")
        self._secret: bytes | None = secret.encode() if isinstance(secret, str) else secret
        for what, v in (("part_bytes", part_bytes),):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1024:
                raise StoreConfigError(f"{what} must be an int >= 1024, got {v!r}")
        for what, v in (("lease_s", lease_s), ("timeout_s", timeout_s), ("retry_after_s", retry_after_s)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise StoreConfigError(f"{what} must be a positive number, got {v!r}")
        if ttl_s is not None and (not isinstance(ttl_s, (int, float)) or ttl_s <= 0):
            raise StoreConfigError(f"ttl_s must be a positive number or None, got {ttl_s!r}")
        for what, path in (("tls_ca_file", tls_ca_file), ("tls_cert_file", tls_cert_file), ("tls_key_file", tls_key_file)):
            if path is not None and not os.path.isfile(path):
                raise StoreConfigError(f"{what} {path!r} is not a file")
        self.part_bytes = part_bytes
        self.ttl_ms = None if ttl_s is None else int(ttl_s * 1000)
        self.lease_ms = int(lease_s * 1000)
        self.timeout_s = float(timeout_s)
        self.retry_after_s = float(retry_after_s)
        self.stats = ValkeyStats()
        self.holder_id = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"
        self._prefix = f"cdq{MANIFEST_VERSION}:{self.trust_domain}:{self.namespace}:"
        self.link = ValkeyLink(
            ep, name=name, timeout_s=self.timeout_s, retry_after_s=self.retry_after_s, stats=self.stats,
            tls={"ca": tls_ca_file, "cert": tls_cert_file, "key": tls_key_file, "verify": bool(tls_verify)},
            hidden=(ep.password, self._secret.decode("latin-1") if self._secret else None),
        )
        self._call = self.link.call
        self._call_or = self.link.call_or
        if self._secret is None:
            log.warning(
                "store tier %r at %s has no secret: entries are unsigned and every writer of that "
                "server is trusted", self.name, ep.address,
            )
        self.link.connect_check()

    # ------------------------------------------------------------------ identity

    @property
    def signed(self) -> bool:
        """Whether entries are signed and verified (a secret is configured)."""
        return self._secret is not None

    @property
    def trust(self) -> str:
        """A plain statement of whom this tier trusts."""
        if self._secret is None:
            return f"unsigned: trusts every writer of {self.endpoint.address}"
        return f"signed: uses only entries signed with trust domain {self.trust_domain!r}'s secret"

    @property
    def available(self) -> bool:
        """False while the tier is answering locally (the server was away at the last try)."""
        return self.link.available

    @property
    def away_reason(self) -> str | None:
        return self.link.away_reason

    def ping(self) -> bool:
        """Whether the server answers now (tries even during the backoff)."""
        return self.link.ping()

    def close(self) -> None:
        """Stop renewing leases (they lapse) and close the connections."""
        super().close()
        self.link.close()

    def __repr__(self) -> str:
        auth = "acl-user" if self.endpoint.username else ("password" if self.endpoint.password else "none")
        return (
            f"ValkeyTier(name={self.name!r}, endpoint={self.endpoint.address!r}, namespace={self.namespace!r}, "
            f"trust_domain={self.trust_domain!r}, auth={auth}, tls={self.endpoint.tls}, "
            f"{'signed' if self.signed else 'unsigned (trusts every writer)'})"
        )

    # ------------------------------------------------------------------ keys and manifests

    def _base(self, key: str) -> str:
        check_key(key)
        return self._prefix + "{" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest() + "}"

    @staticmethod
    def _part_keys(base: str, blob: str, n: int) -> list[str]:
        return [f"{base}:p:{blob[:32]}:{i}" for i in range(n)]

    def _sign(self, body: Mapping[str, Any]) -> str:
        assert self._secret is not None
        msg = _SIG_DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def _manifest(self, key: str, raw: bytes | None) -> dict[str, Any] | None:
        """Parse and judge a manifest read for ``key``.

        Raises:
            _Rejected: unsigned / badly signed / unreadable while a secret is configured.
            CorruptEntryError: unreadable or for another key, without a secret.
        """
        if raw is None:
            return None
        try:
            m = json.loads(raw)
            ok = (
                isinstance(m, dict) and m.get("v") == MANIFEST_VERSION and isinstance(m.get("meta"), dict)
                and isinstance(m.get("blob"), str) and isinstance(m.get("n"), int) and isinstance(m.get("size"), int)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in m["meta"].items())
            )
        except (ValueError, UnicodeDecodeError):
            ok = False
        if self._secret is not None:
            sig = m.pop("sig", None) if ok else None
            if not ok or not isinstance(sig, str) or not hmac.compare_digest(sig, self._sign(m)):
                raise _Rejected(key)
        elif not ok:
            raise CorruptEntryError(f"corrupt store entry {key!r} in {self.endpoint.address}: unreadable manifest")
        else:
            m.pop("sig", None)
        if m.get("key") != key or m.get("domain") != self.trust_domain:
            if self._secret is not None:
                raise _Rejected(key)
            raise CorruptEntryError(f"corrupt store entry {key!r}: its manifest names key {m.get('key')!r}")
        return m

    def _read_manifest(self, client: Any, key: str) -> tuple[bytes | None, dict[str, Any] | None]:
        """(raw, judged manifest) — a rejected one counts and reads as absent."""
        raw = client.get(self._base(key) + ":m")
        try:
            return raw, self._manifest(key, raw)
        except _Rejected:
            self.stats.bump("rejected")
            log.warning("store tier %r: dropped an entry whose signature does not verify (key %s)", self.name, key[:80])
            return raw, None

    def _drop_if_same(self, client: Any, key: str, raw: bytes) -> None:
        client.eval(_DEL_IF_SAME, 1, self._base(key) + ":m", raw)

    # ------------------------------------------------------------------ Tier API

    def _read(self, key: str, expect: Expect, corrupt_ok: bool) -> StoreEntry | None:
        self.stats.bump("gets")
        base = self._base(key)

        def op(c: Any) -> StoreEntry | None:
            raw, m = self._read_manifest(c, key)
            if m is None:
                return None
            expect.check(key, m["meta"])
            pkeys = self._part_keys(base, m["blob"], m["n"])
            parts = c.mget(pkeys) if pkeys else []
            if any(p is None for p in parts):
                self.stats.bump("evicted")
                self._drop_if_same(c, key, raw)  # a manifest whose parts are gone names nothing
                return None
            blob = b"".join(parts)
            try:
                if len(blob) != m["size"] or hashlib.sha256(blob).hexdigest() != m["blob"]:
                    raise CorruptEntryError(f"corrupt store entry {key!r} in {self.endpoint.address}: parts fail the manifest's sha256")
                # the sha256 over every byte (bound to the signed manifest) already covers the data
                entry, _ = decode_entry(key, blob, f"{key!r} in {self.endpoint.address}", verify_data=False)
            except CorruptEntryError:
                self.stats.bump("corrupt")
                if not corrupt_ok:
                    raise
                self._drop_if_same(c, key, raw)
                return None
            self.stats.bump("bytes_read", len(blob))
            if self.ttl_ms is not None:
                pipe = c.pipeline(transaction=False)
                for k in [base + ":m", *pkeys]:
                    pipe.pexpire(k, self.ttl_ms, gt=True)
                pipe.execute()
            return entry

        entry = self._call_or(op, None)
        self.stats.bump("hits" if entry is not None else "misses")
        return entry

    def peek(self, key: str) -> Mapping[str, str] | None:
        _, m = self._call_or(lambda c: self._read_manifest(c, key), (None, None))
        return None if m is None else dict(m["meta"])

    def _peek_for_put(self, c: Any, key: str) -> tuple[bytes | None, dict[str, Any] | None]:
        """(raw manifest, usable manifest or None): garbage is replaced, never compared."""
        raw = c.get(self._base(key) + ":m")
        try:
            return raw, self._manifest(key, raw)
        except (CorruptEntryError, _Rejected):
            return raw, None

    def _named_parts(self, base: str, raw: bytes | None) -> list[str]:
        """Part keys a manifest names, read without judging it (for clean-up only)."""
        try:
            m = json.loads(raw) if raw is not None else None
        except (ValueError, UnicodeDecodeError):
            return []
        if isinstance(m, dict) and isinstance(m.get("blob"), str) and isinstance(m.get("n"), int) and 0 < m["n"] <= 1 << 16:
            return self._part_keys(base, m["blob"], m["n"])
        return []

    def _write(self, key: str, entry: StoreEntry, request: PutRequest) -> PutResult:
        base = self._base(key)
        blob_box: dict[str, Any] = {}

        def op(c: Any) -> PutResult:
            old_raw, old = self._peek_for_put(c, key)
            if not request.overwrite and old is not None and check_collision(key, old["meta"], entry.meta):
                self.stats.bump("put_dedup")
                return PutResult(stored=False)
            if "blob" not in blob_box:
                blob_box["blob"] = encode_entry(key, entry, request.priority)
            blob: bytes = blob_box["blob"]
            digest = hashlib.sha256(blob).hexdigest()
            n = max(1, -(-len(blob) // self.part_bytes))
            pkeys = self._part_keys(base, digest, n)
            body: dict[str, Any] = {
                "v": MANIFEST_VERSION, "key": key, "domain": self.trust_domain, "blob": digest,
                "size": len(blob), "n": n, "priority": request.priority, "meta": dict(entry.meta),
                "payload": entry.nbytes, "writer": self.holder_id, "t": int(time.time() * 1000),
            }
            if self._secret is not None:
                body["sig"] = self._sign(body)
            manifest = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
            pipe = c.pipeline(transaction=False)
            view = memoryview(blob)  # parts are views: no copy before the socket
            for i, pk in enumerate(pkeys):
                pipe.set(pk, view[i * self.part_bytes : (i + 1) * self.part_bytes], px=_ORPHAN_MS)
            pipe.execute()
            # The parts of the version being replaced (whoever wrote it) expire shortly: readers
            # holding its manifest finish, nothing stays behind. Before the new manifest, so a
            # writer dying in between leaves at worst a miss, never a leak.
            stale = [k for k in self._named_parts(base, old_raw) if k not in set(pkeys)]
            if stale:
                pipe = c.pipeline(transaction=False)
                for k in stale:
                    pipe.pexpire(k, _REPLACED_MS)
                pipe.execute()
            # Manifest last: once it exists, every part it names is complete.
            pipe = c.pipeline(transaction=False)
            if self.ttl_ms is None:
                pipe.set(base + ":m", manifest)
                for pk in pkeys:
                    pipe.persist(pk)
            else:
                pipe.set(base + ":m", manifest, px=self.ttl_ms)
                for pk in pkeys:
                    pipe.pexpire(pk, self.ttl_ms)
            pipe.execute()
            self.stats.bump("puts")
            self.stats.bump("bytes_written", len(blob))
            return PutResult(stored=True)

        try:
            res = self._call(op)
        except Away as a:
            self.link.fallback(str(a))
            raise StoreUnavailableError(
                f"store tier {self.name!r} ({self.endpoint.address}) is away ({a}); {key!r} was not shared"
            ) from None
        except CollisionError:
            raise
        except Exception as e:
            import valkey.exceptions as vx

            if isinstance(e, vx.OutOfMemoryError) or (isinstance(e, vx.ResponseError) and str(e).startswith("OOM")):
                raise StoreCapacityError(
                    f"Valkey at {self.endpoint.address} is full (maxmemory with a no-eviction policy): {key!r} not stored"
                ) from None
            raise
        if request.pinned:
            self.pin(key)
        return res

    def delete(self, key: str) -> bool:
        base = self._base(key)

        def op(c: Any) -> bool:
            raw = c.get(base + ":m")
            c.delete(base + ":m", base + ":l", *self._named_parts(base, raw))
            return raw is not None

        with self._lock:
            self._holds().discard(key)
        return bool(self._call_or(op, False))

    def contains(self, key: str) -> bool:
        """Whether a usable manifest is stored (signature verified when a secret is set)."""
        try:
            return self.peek(key) is not None
        except CorruptEntryError:
            return False

    def keys(self) -> list[str]:
        """Store keys of this namespace and trust domain whose manifests are usable (a SCAN over
        every node: for tools and tests, not the serving path)."""

        def op(c: Any) -> list[str]:
            out = []
            for mk in c.scan_iter(match=self._prefix + "*:m", count=1000):
                raw = c.get(mk)
                try:
                    name = json.loads(raw).get("key") if raw is not None else None
                    if not isinstance(name, str) or (self._base(name) + ":m").encode() != (mk if isinstance(mk, bytes) else mk.encode()):
                        continue
                    if self._manifest(name, raw) is not None:
                        out.append(name)
                except (ValueError, UnicodeDecodeError, AttributeError, _Rejected, CorruptEntryError):
                    continue
            return out

        return self._call_or(op, [])

    def nbytes(self) -> int:
        """Payload bytes of this namespace's usable entries (a SCAN: for tools and tests)."""
        total = 0
        for k in self.keys():
            info = self.entry_info(k)
            total += int(info.get("payload", 0)) if info else 0
        return total

    def priority_of(self, key: str) -> int:
        try:
            _, m = self._call(lambda c: self._read_manifest(c, key))
        except (Away, CorruptEntryError):
            return 0
        return 0 if m is None else int(m.get("priority", 0))

    # ------------------------------------------------------------------ leases

    def _lease_now(self, c: Any, keys: list[str]) -> None:
        expiry = int(time.time() * 1000) + self.lease_ms
        pipe = c.pipeline(transaction=False)
        for key in keys:
            base = self._base(key)
            pipe.zadd(base + ":l", {self.holder_id: expiry})
            pipe.pexpireat(base + ":l", expiry, gt=True)
            pipe.pexpireat(base + ":l", expiry, nx=True)
            pipe.pexpireat(base + ":m", expiry, gt=True)  # no-op for entries without a TTL
        pipe.execute()
        if self.ttl_ms is not None:
            for key in keys:  # parts follow their manifest
                _, m = self._read_manifest(c, key)
                if m is None:
                    continue
                pipe = c.pipeline(transaction=False)
                for pk in self._part_keys(self._base(key), m["blob"], m["n"]):
                    pipe.pexpireat(pk, expiry, gt=True)
                pipe.execute()

    def pin(self, key: str) -> bool:
        """Take (or renew) this holder's lease on ``key``; False if absent or the server is away."""
        if not self.contains(key):
            return False
        if self._call_or(lambda c: self._lease_now(c, [key]) or True, False) is False:
            return False
        with self._lock:
            self._holds().add(key)
        self._keep_renewing()
        return True

    # A lease (`Tier.lease`) is the same sorted-set entry as a pin, taken whether or not the entry is
    # stored yet (a window slot holds a chunk whose canonical may be written later): taken now in one
    # round trip, renewed every ``lease_s / 3`` while held, and taken then if the server is away now.
    # A lease on an absent entry is a short-lived marker, harmless.
    def _take_leases(self, keys: list[str]) -> None:
        try:
            self._call_or(lambda c: self._lease_now(c, keys), None)
        except Exception:  # noqa: BLE001 - a lease is bookkeeping: never fail the caller; renewal retries
            log.warning("store tier %r: taking %d leases failed; renewal will retry", self.name, len(keys), exc_info=True)

    def _drop_leases(self, keys: list[str]) -> None:
        def op(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            for key in keys:
                pipe.zrem(self._base(key) + ":l", self.holder_id)
            pipe.execute()

        try:
            self._call_or(op, None)  # away: the lease lapses by itself
        except Exception:  # noqa: BLE001 - the lease lapses by itself
            log.warning("store tier %r: letting go of %d leases failed; they lapse", self.name, len(keys), exc_info=True)

    def unpin(self, key: str) -> bool:
        with self._lock:
            held = key in self._holds()
            self._holds().discard(key)
        removed = self._call_or(lambda c: c.zrem(self._base(key) + ":l", self.holder_id), False)
        return held or bool(removed)

    def is_pinned(self, key: str) -> bool:
        """Whether any holder (any process) has a lease on ``key`` that has not expired."""
        now = int(time.time() * 1000)
        return bool(self._call_or(lambda c: c.zcount(self._base(key) + ":l", now + 1, "+inf"), False))

    @property
    def renew_every_s(self) -> float | None:
        return self.lease_ms / 3000.0

    def renew_leases(self) -> int:
        """Renew this holder's leases and pins (one round trip); 0 while the server is away."""
        keys = sorted(self.leased())
        if not keys:
            return 0
        try:
            self._call(lambda c: self._lease_now(c, keys))
        except Away:
            return 0  # the leases lapse if the server stays away; renewed when it is back
        return len(keys)

    # ------------------------------------------------------------------ tools

    def entry_info(self, key: str) -> dict[str, Any] | None:
        """The judged manifest of ``key`` (parts, sizes, signer domain), for tools and tests."""
        try:
            _, m = self._call(lambda c: self._read_manifest(c, key))
        except Away:
            return None
        if m is None:
            return None
        return {**m, "part_keys": self._part_keys(self._base(key), m["blob"], m["n"]), "manifest_key": self._base(key) + ":m"}
