"""The link between a `ValkeyTier` and its server: where the server is (`ValkeyEndpoint`, parsed
from a URL, credentials kept out of ``repr``), the tier's counters (`ValkeyStats`), which client
failures mean "the server is away" (`classify`), and the connection with its away / back
bookkeeping and backoff (`ValkeyLink`). The tier itself (`contextdeque.stores.valkey`) maps the
tier contract onto the server through ``link.call``.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from contextdeque.core.errors import StoreAuthError, StoreConfigError
from contextdeque.stores.traffic import report_fallback

log = logging.getLogger("contextdeque.stores.valkey")

_SCHEMES = {"valkey": False, "redis": False, "valkeys": True, "rediss": True}


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


VALKEY_COUNTS = (
    "gets", "hits", "misses", "evicted", "corrupt", "rejected", "puts", "put_dedup",
    "bytes_read", "bytes_written", "outages", "recoveries",
)


class ValkeyStats:
    """Counters of one `ValkeyTier` (since construction), read as attributes (``stats.hits``).
    Thread-safe increments via `bump`.

    Counters (`VALKEY_COUNTS`):
        gets / hits / misses: reads, and how they ended (a rejected, evicted or corrupt entry
            counts as a miss too).
        evicted: reads that found a manifest whose parts the server had evicted or expired.
        corrupt: reads whose bytes failed a checksum.
        rejected: reads (and peeks) of entries whose signature did not verify (``secret`` set).
        puts / put_dedup: entries written / puts that found the same content already there.
        bytes_read / bytes_written: entry bytes moved (framing included).
        outages / recoveries: transitions to away and back.
    ``fallbacks``: reason -> operations answered without the server (it was away).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(VALKEY_COUNTS, 0)
        self.fallbacks: dict[str, int] = {}

    def __getattr__(self, name: str) -> int:
        counts = self.__dict__.get("_counts")
        if counts is None or name not in counts:
            raise AttributeError(name)
        return counts[name]

    def bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def fallback(self, reason: str) -> None:
        with self._lock:
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    @property
    def fallbacks_total(self) -> int:
        return sum(self.fallbacks.values())

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {**self._counts, "fallbacks": dict(self.fallbacks)}

    def __repr__(self) -> str:
        return f"ValkeyStats({self.as_dict()})"


class Away(Exception):
    """The server cannot be used right now (reason in args[0])."""


def classify(exc: BaseException) -> str | None:
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


class ValkeyLink:
    """The connection of one tier to its server: the client (made on first use, remade after a
    failure), the first contact's verdict (bad credentials or TLS are configuration errors, an
    absent server only starts the link away), and the away / back bookkeeping with its backoff:
    after a failure the server is not tried again for ``retry_after_s``.

    ``hidden``: strings (password, secret) never to show in a message or the log.
    """

    def __init__(
        self,
        endpoint: ValkeyEndpoint,
        *,
        name: str,
        tls: Mapping[str, Any],
        timeout_s: float,
        retry_after_s: float,
        stats: ValkeyStats,
        hidden: tuple[str | None, ...] = (),
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.stats = stats
        self._tls = dict(tls)
        self._hidden = hidden
        self._client_obj: Any = None
        self._client_lock = threading.Lock()
        self._down_until = 0.0
        self._away_reason: str | None = None

    @property
    def available(self) -> bool:
        """False while the tier is answering locally (the server was away at the last try)."""
        return self._away_reason is None

    @property
    def away_reason(self) -> str | None:
        return self._away_reason

    def call_or(self, fn: Any, default: Any) -> Any:
        """``fn(client)``, or ``default`` (the fallback recorded) when the server is away."""
        try:
            return self.call(fn)
        except Away as a:
            self.fallback(str(a))
            return default

    def redact(self, text: str) -> str:
        """``text`` with every credential and secret replaced by ``***``."""
        for s in self._hidden:
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

    def client(self) -> Any:
        with self._client_lock:
            if self._client_obj is None:
                self._client_obj = self._make_client()
            return self._client_obj

    def connect_check(self) -> None:
        """Refuse bad credentials / TLS settings now; an absent server only starts the tier away."""
        import valkey.exceptions as vx

        try:
            self.client().ping()
        except (vx.ValkeyError, vx.ValkeyClusterException, OSError) as e:
            reason = classify(e)
            text = self.redact(str(e))
            who = f" as user {self.endpoint.username!r}" if self.endpoint.username else ""
            if reason == "auth" or "WRONGPASS" in text or "NOAUTH" in text:
                raise StoreAuthError(
                    f"Valkey at {self.endpoint.address} refused the credentials{who}: {text}"
                ) from None
            if isinstance(e.__context__, ssl.SSLError) or "certificate verify failed" in text or "SSL" in text:
                raise StoreConfigError(f"TLS to Valkey at {self.endpoint.address} failed: {text}") from None
            if reason is None:
                raise StoreConfigError(f"Valkey at {self.endpoint.address} answered with an error: {text}") from None
            self.mark_away(reason, text)

    def mark_away(self, reason: str, detail: str = "") -> None:
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

    def mark_back(self) -> None:
        if self._away_reason is not None:
            self._away_reason = None
            self.stats.bump("recoveries")
            log.warning("store tier %r: Valkey at %s is back; sharing resumes", self.name, self.endpoint.address)

    def call(self, fn: Any) -> Any:
        """Run ``fn(client)``; raise `Away` (after bookkeeping) when the server is away."""
        if self._away_reason is not None and time.monotonic() < self._down_until:
            raise Away("backoff")
        try:
            out = fn(self.client())
        except Exception as e:  # noqa: BLE001 - classified below
            reason = classify(e)
            if reason is None:
                raise
            self.mark_away(reason, self.redact(str(e)))
            raise Away(reason) from None
        self.mark_back()
        return out

    def fallback(self, reason: str) -> None:
        self.stats.fallback(reason)
        report_fallback(self.name, reason)

    def ping(self) -> bool:
        """Whether the server answers now (tries even during the backoff)."""
        self._down_until = 0.0
        try:
            return bool(self.call(lambda c: c.ping()))
        except Away:
            return False

    def close(self) -> None:
        """Close the connections (a later call opens new ones)."""
        with self._client_lock:
            c, self._client_obj = self._client_obj, None
        if c is not None:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass
