"""``python -m peagle_jax.serve`` as a subprocess of a benchmark (``bench.serve``, ``bench.startup``,
``bench.soak``): started on a free loopback port with its output in a log file, polled until a condition
holds (its exit, or a time limit passing first, is a :class:`~peagle_jax.errors.UserError` naming the log),
read over plain HTTP, and stopped with SIGTERM."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from peagle_jax.errors import UserError


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {sample name with its labels: value}."""
    lines = (line for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines)}


class ServerExited(UserError, OSError):
    """The server process is gone: a user error (the benchmark ends with its one line) that callers polling
    an unreachable server (an OSError) see as that."""


class ServerProcess:
    """One server: ``host`` (``127.0.0.1:PORT``), ``url`` (``http://`` + host), ``port``, ``proc``, ``log``,
    and ``started`` (``time.perf_counter()`` just before the process was spawned)."""

    def __init__(self, flags: list[str], log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.host, self.log = f"127.0.0.1:{self.port}", Path(log)
        self.url = f"http://{self.host}"
        cmd = [sys.executable, "-m", "peagle_jax.serve", *flags, "--port", str(self.port)]
        self.started = time.perf_counter()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """``GET path``: (status, body), an HTTP error status included; OSError where nothing answers, and
        :meth:`exited` where that is because the server has exited."""
        conn = http.client.HTTPConnection(self.host, timeout=timeout)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read()
        except OSError as err:
            if not isinstance(err, ServerExited) and self.proc.poll() is not None:
                raise self.exited() from None
            raise
        finally:
            conn.close()

    def exited(self) -> ServerExited:
        """The error of a server that has exited: its status (a kill by signal 9 on Linux is most often the
        kernel's out-of-memory killer) and its log."""
        code = self.proc.returncode
        why = " (killed: out of memory?)" if code == -9 else ""
        return ServerExited(f"the server exited with status {code}{why}; its log: {self.log}")

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name with its labels: value}."""
        return parse_metrics(self.get("/metrics", timeout=10)[1].decode())

    def model_id(self) -> str:
        return json.loads(self.get("/v1/models")[1])["data"][0]["id"]

    def health(self) -> dict | None:
        """/health's body when it answers 200 (ready), else None."""
        status, body = self.get("/health")
        return json.loads(body) if status == 200 else None

    def wait(self, done, timeout: float, every: float = 0.05):
        """Poll ``done()`` until it returns something other than None (an OSError counts as None: the port is
        not listening yet) and return it; ``timeout`` counts from the server's start."""
        while time.perf_counter() - self.started < timeout:
            if self.proc.poll() is not None:
                raise self.exited()
            try:
                value = done()
            except OSError:
                value = None
            if value is not None:
                return value
            time.sleep(every)
        raise UserError(f"the server did not get there within {timeout:.0f} s of starting; its log: {self.log}")

    def wait_ready(self, timeout: float, all_graphs: bool = False) -> dict:
        """/health's body once it is ready (and, with ``all_graphs``, has no graph left to compile)."""

        def ready():
            body = self.health()
            return body if body is not None and (not all_graphs or body.get("graphs_pending") == 0) else None

        return self.wait(ready, timeout)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM, then the exit status (None: killed after ``timeout`` s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None
