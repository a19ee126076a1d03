"""Running `contextdeque serve` processes for tests: start, wait for the port, read metrics,
SIGKILL and restart; everything the process writes to stderr is kept (to check no secret is
ever logged)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

from contextdeque.serve.metrics import parse_text


class ServeProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None, threads: int = 1, port: int = 0) -> None:
        self.args = ["--port", str(port), "--threads", str(threads), "--log-level", "info", *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.output: list[str] = []
        self._reader: threading.Thread | None = None

    def start(self, timeout: float = 300) -> "ServeProcess":
        return self.launch().wait_ready(timeout)

    def launch(self) -> "ServeProcess":
        """Start the process without waiting (see `wait_ready`): replicas load in parallel."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "contextdeque.cli", "serve", *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env,
        )
        ready = self._ready = threading.Event()

        def read(proc: subprocess.Popen) -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.output.append(line)
                m = re.search(r"listening on (http://\S+)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        self._reader = threading.Thread(target=read, args=(self.proc,), daemon=True)
        self._reader.start()
        return self

    def wait_ready(self, timeout: float = 300) -> "ServeProcess":
        assert self.proc is not None
        self._ready.wait(timeout)
        if not self.url or self.proc.poll() is not None:
            raise RuntimeError("serve did not start:\n" + "".join(self.output[-50:]))
        return self

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def restarted(self) -> "ServeProcess":
        """A new process with the same arguments on the same port (after `kill`)."""
        args = list(self.args)
        args[args.index("--port") + 1] = str(self.port)
        fresh = ServeProcess(env=self.env)
        fresh.args = args
        return fresh.start()

    @property
    def log(self) -> str:
        return "".join(self.output)

    def client(self, api_key: str = "none", **kw: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kw)

    def metrics(self, api_key: str | None = None) -> dict[str, float]:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        r = httpx.get(self.url + "/metrics", headers=headers, timeout=30)
        r.raise_for_status()
        return parse_text(r.text)

    def kill(self) -> None:
        """SIGKILL (no clean-up at all)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def wait_exit(self, timeout: float = 300) -> int:
        assert self.proc is not None
        rc = self.proc.wait(timeout)
        if self._reader is not None:
            self._reader.join(10)
        return rc

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(10)

    def __enter__(self) -> "ServeProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def metric(m: dict[str, float], name: str, **labels: str) -> float:
    """The value of ``name{labels}`` (0 when absent); without labels, the sum over all label sets."""
    if labels:
        key = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
        return m.get(key, 0.0)
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))


def wait_until(pred: Any, timeout: float = 30.0, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())
