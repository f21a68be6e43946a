"""Starts `asrserve serve` as a real subprocess on a free loopback port."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


# The tests' client for plain-HTTP servers. httpx's top-level get/post build a client, and with it
# a TLS context (~50 ms of CPU loading CA certificates), per call: on 2 cores that CPU came from the
# server under test. No keep-alive, so each request has its own connection as top-level calls had.
NO_KEEP_ALIVE = httpx.Limits(max_keepalive_connections=0)
http = httpx.Client(limits=NO_KEEP_ALIVE)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, port: int | None = None,
                 new_session: bool = False):
        self.port = port or free_port()
        # Served over TLS: the certificate is its own CA (self-signed), which clients trust.
        tls = "--ssl-certfile" in args
        self.verify = ssl.create_default_context(cafile=args[args.index("--ssl-certfile") + 1]) if tls else True
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="asrserve-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "asrserve", "serve", *args]
        if "--port" not in args and not (env and "ASRSERVE_PORT" in env):
            command += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            cwd=Path(__file__).resolve().parents[1], start_new_session=new_session,
        )
        self.health_statuses: list[int] = []  # every /health status seen while starting
        # The harness's own polls (/health, /metrics) through `http` above; a server over TLS gets a
        # client of its own, which trusts its certificate (the certificate is its own CA).
        self.http = http if self.verify is True else httpx.Client(
            verify=self.verify, limits=NO_KEEP_ALIVE)

    def wait_ready(self, timeout: float = 120.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.logs()}")
            try:
                status = self.http.get(f"{self.url}/health", timeout=5).status_code
                self.health_statuses.append(status)
                if status == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.logs()}")

    def engine_pid(self) -> int:
        """The engine process: the server's child running multiprocessing's spawn entry point."""
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
                if b"multiprocessing" in cmdline and b"resource_tracker" not in cmdline:
                    return int(child)
        raise RuntimeError("no engine process found")

    def tree_rss_bytes(self) -> int:
        """Resident memory of the server and every process under it (the engine)."""
        total, pending = 0, [self.process.pid]
        while pending:
            pid = pending.pop()
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                for task in Path(f"/proc/{pid}/task").iterdir():
                    pending.extend(int(child) for child in (task / "children").read_text().split())
            except (FileNotFoundError, ProcessLookupError):
                continue  # it exited meanwhile
            rss_kb = next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))
            total += int(rss_kb) * 1024
        return total

    def logs(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def metrics(self) -> dict[str, float]:
        """Sample name (with labels) -> value, from /metrics."""
        text = self.http.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.http is not http:
            self.http.close()
        self.log.close()
        os.unlink(self.log.name)
