"""Prometheus metrics of one serving process (``GET /metrics``, Prometheus text format).

Counters a request adds to (``contextdeque_`` prefix): ``requests_total{endpoint,status}``,
``prompt_tokens_total`` (what a plain server would prefill), ``tokens_prefilled_total`` (what
this one did: encodes, patch-forming forwards and the generation prompt),
``prefill_avoided_tokens_total``, ``completion_tokens_total``, ``encode_forwards_total``,
``patch_forwards_total``, ``patches_reused_total``, ``store_fallbacks_total{tier}`` (store
operations answered locally because a remote tier was away), ``sessions_evicted_total``,
``sessions_restored_total``, ``fidelity_misses_total{action}`` (patches a session's
``fidelity_target`` could not fit within the byte cap: ``reported`` ones fall short, the others
took more bytes) with the histogram ``fidelity_miss_eta`` (their estimated η); idle-time healing (latency-first policy): ``heal_steps_total``,
``heal_interrupted_total`` (steps abandoned because a request arrived), ``heal_errors_total``,
``heal_forwards_total``, ``heal_tokens_prefilled_total``, ``heal_encodes_total`` (canonicals
computed while idle), ``heal_patches_formed_total``, ``heal_seconds``; histograms ``request_seconds``, ``ttft_seconds``,
``queue_wait_seconds``. Read at scrape time: ``store_lookups_total{kind,tier}`` (chunk / patch /
embeds lookups by the tier that served them, ``tier="miss"`` when none did), the Valkey tier's
``valkey_*_total`` counters (hits, misses, evicted, corrupt, rejected signatures, fallbacks by
reason, outages, leases held) and ``valkey_available``, ``sessions``, ``session_bytes``,
``heal_pending_chunks``, ``queue_depth``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..core.counters import Counters

disable_created_metrics()  # no *_created series: they double the page and no dashboard reads them

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine, GenerationResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


class _ScrapeCollector:
    """Values read from the engine and the store at scrape time."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine

    def collect(self) -> Iterable[Any]:
        from ..window.store import WindowStore

        e = self.engine
        lookups = CounterMetricFamily("contextdeque_store_lookups", "chunk/patch/embeds lookups by the tier that served them", labels=["kind", "tier"])
        for (kind, tier), n in sorted(WindowStore.wrap(e.store).lookups.items()):
            lookups.add_metric([kind, tier], n)
        yield lookups
        for t in e.store.tiers:
            stats = getattr(t, "stats", None)
            if stats is None or not hasattr(stats, "as_dict"):
                continue
            d = stats.as_dict()
            for name in ("gets", "hits", "misses", "evicted", "corrupt", "rejected", "puts", "bytes_read", "bytes_written", "outages", "recoveries"):
                c = CounterMetricFamily(f"contextdeque_valkey_{name}", f"Valkey tier: {name}", labels=["tier"])
                c.add_metric([t.name], d[name])
                yield c
            fb = CounterMetricFamily("contextdeque_valkey_fallbacks", "Valkey tier operations answered locally, by reason", labels=["tier", "reason"])
            for reason, n in sorted(d["fallbacks"].items()):
                fb.add_metric([t.name, reason], n)
            yield fb
            if hasattr(t, "leased"):
                lg = GaugeMetricFamily("contextdeque_valkey_leases", "store keys this process holds leases on (its sessions' chunks and patches)", labels=["tier"])
                lg.add_metric([t.name], float(len(t.leased())))
                yield lg
            g = GaugeMetricFamily("contextdeque_valkey_available", "1 while the Valkey tier answers", labels=["tier", "signed"])
            g.add_metric([t.name, str(bool(getattr(t, "signed", False))).lower()], 1.0 if t.available else 0.0)
            yield g
        yield GaugeMetricFamily("contextdeque_sessions", "sessions held in memory", value=len(e.sessions))
        yield GaugeMetricFamily("contextdeque_session_bytes", "bytes of the sessions' window pages", value=e.session_bytes())
        yield GaugeMetricFamily("contextdeque_heal_pending_chunks", "chunks a latency-first policy left to heal", value=e.pending_chunks())


# Counters field -> (metric, help): what a request's work and a heal step's work add to
REQUEST_WORK = {
    "tokens_prefilled": ("contextdeque_tokens_prefilled", "tokens this server prefilled (encodes, patch forwards, generation prompt)"),
    "encodes": ("contextdeque_encode_forwards", "chunk encode forwards (content the store had never seen)"),
    "patches_formed": ("contextdeque_patch_forwards", "conditioned forwards forming patches"),
    "patches_reused": ("contextdeque_patches_reused", "patches served by the store"),
}
HEAL_WORK = {
    "forwards": ("contextdeque_heal_forwards", "model forwards run while healing"),
    "tokens_prefilled": ("contextdeque_heal_tokens_prefilled", "tokens prefilled while healing (off the request path)"),
    "encodes": ("contextdeque_heal_encodes", "canonicals encoded while healing"),
    "patches_formed": ("contextdeque_heal_patches_formed", "patches formed while healing"),
}


def _count(metrics: dict[str, Any], work: Counters) -> None:
    """Add a record's counts (a ``Counters``: a request's result, a heal step's receipt) to ``metrics``."""
    for field, metric in metrics.items():
        metric.inc(getattr(work, field))


class ServeMetrics:
    """The metrics of one engine, in their own registry."""

    def __init__(self, engine: "Engine") -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("contextdeque_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("contextdeque_prompt_tokens", "prompt tokens a plain server would prefill", registry=r)
        self.avoided = Counter("contextdeque_prefill_avoided_tokens", "prompt tokens served without a forward", registry=r)
        self.completion_tokens = Counter("contextdeque_completion_tokens", "tokens generated", registry=r)
        # the requests' and the heal steps' work, per Counters field that has a metric
        self.work = {field: Counter(name, doc, registry=r) for field, (name, doc) in REQUEST_WORK.items()}
        self.heal_work = {field: Counter(name, doc, registry=r) for field, (name, doc) in HEAL_WORK.items()}
        self.fallbacks = Counter("contextdeque_store_fallbacks", "store operations answered locally because a remote tier was away", ["tier"], registry=r)
        self.sessions_evicted = Counter("contextdeque_sessions_evicted", "sessions closed by the memory budget", registry=r)
        self.sessions_restored = Counter("contextdeque_sessions_restored", "sessions rebuilt from the store with no encode", registry=r)
        self.fidelity_misses = Counter("contextdeque_fidelity_misses", "patches the byte cap could not fit the fidelity target into, by what on_miss did", ["action"], registry=r)
        self.fidelity_miss_eta = Histogram("contextdeque_fidelity_miss_eta", "estimated η of patches short of the fidelity target within the byte cap",
                                           buckets=(0.5, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 1.0), registry=r)
        self.latency = Histogram("contextdeque_request_seconds", "chat completion wall time", buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("contextdeque_ttft_seconds", "time to the first generated token", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("contextdeque_queue_wait_seconds", "time waiting for the model worker", buckets=_LATENCY_BUCKETS, registry=r)
        self.heal_steps = Counter("contextdeque_heal_steps", "heal steps completed in idle time", registry=r)
        self.heal_interrupted = Counter("contextdeque_heal_interrupted", "heal steps abandoned because a request arrived", registry=r)
        self.heal_errors = Counter("contextdeque_heal_errors", "heal steps that failed (the window stays as served until its next request)", registry=r)
        self.heal_seconds = Histogram("contextdeque_heal_seconds", "wall time of one heal step", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("contextdeque_queue_depth", "requests waiting for the model worker", registry=r)
        r.register(_ScrapeCollector(engine))

    def record(self, res: "GenerationResult", receipts: list[Any], wall_s: float) -> None:
        self.prompt_tokens.inc(res.prompt_tokens)
        _count(self.work, res)
        self.avoided.inc(max(0, res.prompt_tokens - res.tokens_prefilled))
        self.completion_tokens.inc(len(res.token_ids))
        for tier, n in res.fallbacks.items():
            self.fallbacks.labels(tier).inc(n)
        if res.restored:
            self.sessions_restored.inc()
        self.record_fidelity(res.fidelity_misses)
        self.latency.observe(wall_s)
        if res.ttft_s is not None:
            self.ttft.observe(res.ttft_s)

    def record_heal(self, rec: Any, step: Any, wall_s: float) -> None:
        """One heal step's receipt (``rec``: merged; ``step``: the step's own, for its store traffic)."""
        self.heal_steps.inc()
        _count(self.heal_work, rec)
        self.heal_seconds.observe(wall_s)
        self.record_fidelity([m.as_dict() for m in rec.fidelity_misses])
        if step is not None:
            for tier, n in step.traffic.fallbacks.items():
                self.fallbacks.labels(tier).inc(n)

    def record_fidelity(self, misses: list[dict[str, Any]]) -> None:
        """Count fidelity misses (``FidelityMiss.as_dict()``) and their estimated η."""
        for m in misses:
            self.fidelity_misses.labels(m["action"]).inc()
            if m["action"] == "reported" and m.get("eta_est") is not None:
                self.fidelity_miss_eta.observe(float(m["eta_est"]))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_text(text: str) -> dict[str, float]:
    """``{"name{labels}": value}`` of a Prometheus text page (tests, loadtest)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out
