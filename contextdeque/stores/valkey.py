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
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from contextdeque.core.errors import (
    CollisionError,
    CorruptEntryError,
    StoreAuthError,
    StoreCapacityError,
    StoreConfigError,
    StoreUnavailableError,
)
from contextdeque.stores.base import PutResult, StoreEntry, Tier, check_collision, check_expectations
from contextdeque.stores.format import decode_entry, encode_entry
from contextdeque.stores.traffic import report_fallback

log = logging.getLogger("contextdeque.stores.valkey")

MANIFEST_VERSION = 1
DEFAULT_PART_BYTES = 4 * 1024 * 1024
_ORPHAN_MS = 10 * 60 * 1000  # parts not yet named by a manifest expire after this
_REPLACED_MS = 30 * 1000  # parts of a replaced version: long enough for readers in flight
_SIG_DOMAIN = b"cdq-valkey-entry-v1\0"
_NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
_SCHEMES = {"valkey": False, "redis": False, "valkeys": True, "rediss": True}

# compare-and-delete: drop a manifest only if it still is the one we judged (one key: one slot)
_DEL_IF_SAME = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end"


def _check_name(what: str, value: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 128 or not set(value) <= _NAME_OK:
        raise StoreConfigError(f"{what} must be 1-128 characters of [A-Za-z0-9._-], got {value!r}")
    return value


@dataclass(frozen=True)
class ValkeyEndpoint:
    """Where the server is, parsed from a URL; the password is kept out of ``repr``.

    URL forms: ``valkey://[user[:password]@]host:port[/db]``, ``valkeys://`` (TLS), the
    ``redis``/``rediss`` spellings, and a ``+cluster`` suffix on the scheme
    (``valkey+cluster://host:port``) for a cluster (any node is a start node).
    """

    host: str
    port: int
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    cluster: bool = False

    @classmethod
    def parse(cls, url: str) -> "ValkeyEndpoint":
        """Parse ``url`` (see the class docstring).

        Raises:
            StoreConfigError: not such a URL (the message shows it with the password hidden).
        """
        if not isinstance(url, str):
            raise StoreConfigError(f"store URL must be a str, got {type(url).__name__}")
        try:
            parts = urlsplit(url)
            scheme, _, extra = parts.scheme.partition("+")
            port = parts.port or 6379
            host = parts.hostname
        except ValueError as e:
            raise StoreConfigError(f"bad store URL {redact_url(url)!r}: {e}") from None
        if scheme not in _SCHEMES or extra not in ("", "cluster") or not host:
            raise StoreConfigError(
                f"bad store URL {redact_url(url)!r}: expected valkey://[user[:password]@]host:port/db "
                "(or valkeys:// for TLS, valkey+cluster:// for a cluster)"
            )
        path = parts.path.strip("/")
        try:
            db = int(path) if path else int(parse_qs(parts.query).get("db", ["0"])[0])
        except ValueError:
            raise StoreConfigError(f"bad store URL {redact_url(url)!r}: database must be an integer") from None
        cluster = extra == "cluster"
        if cluster and db != 0:
            raise StoreConfigError("a Valkey cluster has only database 0")
        return cls(
            host=host, port=int(port), db=db,
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password is not None else None,
            tls=_SCHEMES[scheme], cluster=cluster,
        )

    @property
    def address(self) -> str:
        """``scheme://host:port/db`` without credentials (safe to log)."""
        scheme = ("valkeys" if self.tls else "valkey") + ("+cluster" if self.cluster else "")
        return f"{scheme}://{self.host}:{self.port}/{self.db}"


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.rsplit("@", 1)
        user = parts.username or ""
        return url.replace(parts.netloc, f"{user}:***@{netloc[-1]}", 1)
    except ValueError:
        return "<unparseable URL>"


@dataclass
class ValkeyStats:
    """Counters of one `ValkeyTier` (since construction). Thread-safe increments via `bump`.

    Attributes:
        gets / hits / misses: reads, and how they ended (a rejected, evicted or corrupt entry
            counts as a miss too).
        evicted: reads that found a manifest whose parts the server had evicted or expired.
        corrupt: reads whose bytes failed a checksum.
        rejected: reads (and peeks) of entries whose signature did not verify (``secret`` set).
        puts / put_dedup: entries written / puts that found the same content already there.
        bytes_read / bytes_written: entry bytes moved (framing included).
        fallbacks: reason -> operations answered without the server (it was away).
        outages / recoveries: transitions to away and back.
    """

    gets: int = 0
    hits: int = 0
    misses: int = 0
    evicted: int = 0
    corrupt: int = 0
    rejected: int = 0
    puts: int = 0
    put_dedup: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    outages: int = 0
    recoveries: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def fallback(self, reason: str) -> None:
        with self._lock:
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    @property
    def fallbacks_total(self) -> int:
        return sum(self.fallbacks.values())

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            d = {k: getattr(self, k) for k in self.__dataclass_fields__ if not k.startswith("_")}
            d["fallbacks"] = dict(self.fallbacks)
        return d


class _Rejected(Exception):
    """A manifest that must not be used (bad signature, unreadable under a secret)."""


class _Away(Exception):
    """The server cannot be used right now (reason in args[0])."""


def _classify(exc: BaseException) -> str | None:
    """Why a client exception means 'the server is away' (None: it is another failure)."""
    import valkey.exceptions as vx

    if isinstance(exc, (vx.AuthenticationError, vx.AuthorizationError, vx.AuthenticationWrongNumberOfArgsError)):
        return "auth"
    if isinstance(exc, vx.NoPermissionError):
        return "auth"
    if isinstance(exc, vx.BusyLoadingError):
        return "loading"
    if isinstance(exc, (vx.TimeoutError, socket.timeout, TimeoutError)):
        return "timeout"
    if isinstance(exc, (vx.ConnectionError, ConnectionError, OSError)):
        return "unreachable"
    if isinstance(exc, (vx.ClusterError, vx.SlotNotCoveredError, vx.TryAgainError, vx.ValkeyClusterException)):
        return "cluster"
    if isinstance(exc, vx.ResponseError) and str(exc).startswith(("LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN")):
        return "loading"
    return None


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
        self._tls = {"ca": tls_ca_file, "cert": tls_cert_file, "key": tls_key_file, "verify": bool(tls_verify)}
        self.stats = ValkeyStats()
        self.holder_id = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"
        self._prefix = f"cdq{MANIFEST_VERSION}:{self.trust_domain}:{self.namespace}:"
        self._client_obj: Any = None
        self._client_lock = threading.Lock()
        self._down_until = 0.0
        self._away_reason: str | None = None
        self._leases: set[str] = set()
        self._lease_thread: threading.Thread | None = None
        self._closed = threading.Event()
        if self._secret is None:
            log.warning(
                "store tier %r at %s has no secret: entries are unsigned and every writer of that "
                "server is trusted", self.name, ep.address,
            )
        self._connect_check()

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
        return self._away_reason is None

    @property
    def away_reason(self) -> str | None:
        return self._away_reason

    def __repr__(self) -> str:
        auth = "acl-user" if self.endpoint.username else ("password" if self.endpoint.password else "none")
        return (
            f"ValkeyTier(name={self.name!r}, endpoint={self.endpoint.address!r}, namespace={self.namespace!r}, "
            f"trust_domain={self.trust_domain!r}, auth={auth}, tls={self.endpoint.tls}, "
            f"{'signed' if self.signed else 'unsigned (trusts every writer)'})"
        )

    # ------------------------------------------------------------------ connection

    def _redact(self, text: str) -> str:
        for s in (self.endpoint.password, self._secret.decode("latin-1") if self._secret else None):
            if s:
                text = text.replace(s, "***")
        return text

    def _client_kwargs(self) -> dict[str, Any]:
        ep = self.endpoint
        kw: dict[str, Any] = {
            "host": ep.host, "port": ep.port, "username": ep.username, "password": ep.password,
            "socket_timeout": self.timeout_s, "socket_connect_timeout": self.timeout_s,
        }
        if not ep.cluster:
            kw["db"] = ep.db
            kw["retry_on_timeout"] = False
        if ep.tls:
            kw.update(ssl=True, ssl_ca_certs=self._tls["ca"], ssl_certfile=self._tls["cert"],
                      ssl_keyfile=self._tls["key"],
                      ssl_cert_reqs="required" if self._tls["verify"] else "none",
                      ssl_check_hostname=bool(self._tls["verify"]))
        return kw

    def _make_client(self) -> Any:
        import valkey
        from valkey.backoff import NoBackoff
        from valkey.retry import Retry

        kw = self._client_kwargs()
        if self.endpoint.cluster:
            from valkey.cluster import ValkeyCluster

            # One attempt per command: the tier's own backoff decides when to try again.
            return ValkeyCluster(**kw, cluster_error_retry_attempts=1, retry=Retry(NoBackoff(), 0))
        return valkey.Valkey(**kw, retry=Retry(NoBackoff(), 0), health_check_interval=0)

    def _client(self) -> Any:
        with self._client_lock:
            if self._client_obj is None:
                self._client_obj = self._make_client()
            return self._client_obj

    def _connect_check(self) -> None:
        """Refuse bad credentials / TLS settings now; an absent server only starts the tier away."""
        import valkey.exceptions as vx

        try:
            self._client().ping()
        except (vx.ValkeyError, vx.ValkeyClusterException, OSError) as e:
            reason = _classify(e)
            text = self._redact(str(e))
            who = f" as user {self.endpoint.username!r}" if self.endpoint.username else ""
            if reason == "auth" or "WRONGPASS" in text or "NOAUTH" in text:
                raise StoreAuthError(
                    f"Valkey at {self.endpoint.address} refused the credentials{who}: {text}"
                ) from None
            if isinstance(e.__context__, ssl.SSLError) or "certificate verify failed" in text or "SSL" in text:
                raise StoreConfigError(f"TLS to Valkey at {self.endpoint.address} failed: {text}") from None
            if reason is None:
                raise StoreConfigError(f"Valkey at {self.endpoint.address} answered with an error: {text}") from None
            self._mark_away(reason, text)

    def _mark_away(self, reason: str, detail: str = "") -> None:
        if self._away_reason is None:
            self.stats.bump("outages")
            log.warning(
                "store tier %r: Valkey at %s is away (%s%s); answering from the local tiers, "
                "retrying every %.1fs", self.name, self.endpoint.address, reason,
                f": {detail}" if detail else "", self.retry_after_s,
            )
        self._away_reason = reason
        self._down_until = time.monotonic() + self.retry_after_s
        with self._client_lock:
            old, self._client_obj = self._client_obj, None
        if old is not None:
            try:
                old.close()
            except Exception:  # noqa: BLE001 - a broken client may fail to close
                pass

    def _mark_back(self) -> None:
        if self._away_reason is not None:
            self._away_reason = None
            self.stats.bump("recoveries")
            log.warning("store tier %r: Valkey at %s is back; sharing resumes", self.name, self.endpoint.address)

    def _call(self, fn: Any) -> Any:
        """Run ``fn(client)``; raise `_Away` (after bookkeeping) when the server is away."""
        if self._away_reason is not None and time.monotonic() < self._down_until:
            raise _Away("backoff")
        try:
            out = fn(self._client())
        except Exception as e:  # noqa: BLE001 - classified below
            reason = _classify(e)
            if reason is None:
                raise
            self._mark_away(reason, self._redact(str(e)))
            raise _Away(reason) from None
        self._mark_back()
        return out

    def _fallback(self, reason: str) -> None:
        self.stats.fallback(reason)
        report_fallback(self.name, reason)

    def ping(self) -> bool:
        """Whether the server answers now (tries even during the backoff)."""
        self._down_until = 0.0
        try:
            return bool(self._call(lambda c: c.ping()))
        except _Away:
            return False

    def close(self) -> None:
        """Stop renewing leases (they lapse) and close the connections."""
        self._closed.set()
        with self._client_lock:
            c, self._client_obj = self._client_obj, None
        if c is not None:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass

    # ------------------------------------------------------------------ keys and manifests

    def _base(self, key: str) -> str:
        if not isinstance(key, str):
            raise TypeError(f"store keys are str, got {type(key).__name__}")
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

    def get(
        self,
        key: str,
        *,
        expect_fingerprint: str | None = None,
        expect_layout: str | None = None,
        expect_digest: str | None = None,
        corrupt_ok: bool = False,
    ) -> StoreEntry | None:
        self.stats.bump("gets")
        base = self._base(key)

        def op(c: Any) -> StoreEntry | None:
            raw, m = self._read_manifest(c, key)
            if m is None:
                return None
            check_expectations(
                key, m["meta"], expect_fingerprint=expect_fingerprint,
                expect_layout=expect_layout, expect_digest=expect_digest,
            )
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

        try:
            entry = self._call(op)
        except _Away as a:
            self._fallback(str(a))
            entry = None
        self.stats.bump("hits" if entry is not None else "misses")
        return entry

    def peek(self, key: str) -> Mapping[str, str] | None:
        try:
            _, m = self._call(lambda c: self._read_manifest(c, key))
        except _Away as a:
            self._fallback(str(a))
            return None
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

    def put(
        self,
        key: str,
        entry: StoreEntry,
        *,
        pinned: bool = False,
        priority: int = 0,
        overwrite: bool = False,
        keep_evicted: bool = False,
        copy: bool = True,
    ) -> PutResult:
        entry.user_meta_check()
        base = self._base(key)
        blob_box: dict[str, Any] = {}

        def op(c: Any) -> PutResult:
            old_raw, old = self._peek_for_put(c, key)
            if not overwrite and old is not None and check_collision(key, old["meta"], entry.meta):
                self.stats.bump("put_dedup")
                return PutResult(stored=False)
            if "blob" not in blob_box:
                blob_box["blob"] = encode_entry(key, entry, priority)
            blob: bytes = blob_box["blob"]
            digest = hashlib.sha256(blob).hexdigest()
            n = max(1, -(-len(blob) // self.part_bytes))
            pkeys = self._part_keys(base, digest, n)
            body: dict[str, Any] = {
                "v": MANIFEST_VERSION, "key": key, "domain": self.trust_domain, "blob": digest,
                "size": len(blob), "n": n, "priority": int(priority), "meta": dict(entry.meta),
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
        except _Away as a:
            self._fallback(str(a))
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
        if pinned:
            self.pin(key)
        return res

    def delete(self, key: str) -> bool:
        base = self._base(key)

        def op(c: Any) -> bool:
            raw = c.get(base + ":m")
            c.delete(base + ":m", base + ":l", *self._named_parts(base, raw))
            return raw is not None

        with self._lock:
            self._leases.discard(key)
        try:
            return bool(self._call(op))
        except _Away as a:
            self._fallback(str(a))
            return False

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

        try:
            return self._call(op)
        except _Away as a:
            self._fallback(str(a))
            return []

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
        except (_Away, CorruptEntryError):
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
        try:
            self._call(lambda c: self._lease_now(c, [key]))
        except _Away as a:
            self._fallback(str(a))
            return False
        self._hold_leases([key])
        return True

    def lease(self, keys: "list[str] | tuple[str, ...]") -> None:
        """Hold leases on ``keys`` from now on, whether or not they are stored yet (a window slot
        holds a chunk whose canonical may be written later): taken now in one round trip, renewed
        every ``lease_s / 3`` while this tier holds them, and taken then if the server is away
        now. A lease on an absent entry is a short-lived marker, harmless."""
        with self._lock:
            keys = [k for k in keys if k not in self._leases]
        if not keys:
            return
        self._hold_leases(keys)
        try:
            self._call(lambda c: self._lease_now(c, keys))
        except _Away as a:
            self._fallback(str(a))
        except Exception:  # noqa: BLE001 - a lease is bookkeeping: never fail the caller; renewal retries
            log.warning("store tier %r: taking %d leases failed; renewal will retry", self.name, len(keys), exc_info=True)

    def unlease(self, keys: "list[str] | tuple[str, ...]") -> None:
        """Let go of this holder's leases on ``keys`` (the entries' own TTL applies again)."""
        with self._lock:
            keys = [k for k in keys if k in self._leases]
            self._leases.difference_update(keys)
        if not keys:
            return

        def op(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            for key in keys:
                pipe.zrem(self._base(key) + ":l", self.holder_id)
            pipe.execute()

        try:
            self._call(op)
        except _Away as a:
            self._fallback(str(a))  # the lease lapses by itself
        except Exception:  # noqa: BLE001 - the lease lapses by itself
            log.warning("store tier %r: letting go of %d leases failed; they lapse", self.name, len(keys), exc_info=True)

    def _hold_leases(self, keys: "list[str]") -> None:
        with self._lock:
            self._leases.update(keys)
            if self._lease_thread is None:
                self._lease_thread = threading.Thread(target=self._renew_loop, name=f"valkey-leases-{self.name}", daemon=True)
                self._lease_thread.start()

    def unpin(self, key: str) -> bool:
        with self._lock:
            held = key in self._leases
            self._leases.discard(key)
        try:
            removed = self._call(lambda c: c.zrem(self._base(key) + ":l", self.holder_id))
        except _Away as a:
            self._fallback(str(a))
            return held
        return held or bool(removed)

    def is_pinned(self, key: str) -> bool:
        """Whether any holder (any process) has a lease on ``key`` that has not expired."""
        now = int(time.time() * 1000)
        try:
            return bool(self._call(lambda c: c.zcount(self._base(key) + ":l", now + 1, "+inf")))
        except _Away as a:
            self._fallback(str(a))
            return False

    def leased(self) -> set[str]:
        """Keys this tier instance holds leases on (renewed in the background)."""
        with self._lock:
            return set(self._leases)

    def _renew_loop(self) -> None:
        period = self.lease_ms / 3000.0
        while not self._closed.wait(period):
            keys = sorted(self.leased())
            if not keys:
                continue
            try:
                self._call(lambda c: self._lease_now(c, keys))
            except _Away:
                continue  # the leases lapse if the server stays away; renewed when it is back
            except Exception:  # noqa: BLE001 - never let the renewer die on one bad reply
                log.exception("store tier %r: lease renewal failed", self.name)

    # ------------------------------------------------------------------ tools

    def entry_info(self, key: str) -> dict[str, Any] | None:
        """The judged manifest of ``key`` (parts, sizes, signer domain), for tools and tests."""
        try:
            _, m = self._call(lambda c: self._read_manifest(c, key))
        except _Away:
            return None
        if m is None:
            return None
        return {**m, "part_keys": self._part_keys(self._base(key), m["blob"], m["n"]), "manifest_key": self._base(key) + ":m"}
