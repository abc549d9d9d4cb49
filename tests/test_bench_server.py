"""The benchmarks' server subprocess (peagle_jax.bench.server): a server that exits while starting is one
UserError naming its log and exit status, and /metrics text parses into samples with their labels."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from peagle_jax.bench.server import ServerProcess, parse_metrics
from peagle_jax.errors import UserError


def test_a_server_that_exits_while_starting_is_a_user_error_naming_its_log(tmp_path):
    log = tmp_path / "server.log"
    server = ServerProcess(["--model", str(tmp_path / "missing")], log)
    with pytest.raises(UserError, match=r"the server exited with status 2; its log: .*server\.log"):
        server.wait_ready(120)
    assert "error:" in log.read_text()
    assert server.stop() == 2


def test_parse_metrics_keeps_labels_and_skips_comments():
    text = '# HELP x y\n# TYPE x counter\npeagle_requests_total{endpoint="chat",status="ok"} 3\npeagle_up 1.5\n'
    assert parse_metrics(text) == {'peagle_requests_total{endpoint="chat",status="ok"}': 3.0, "peagle_up": 1.5}


def test_a_server_killed_while_serving_is_a_user_error_that_pollers_see_as_unreachable(tmp_path):
    """A request to a server that has died (here a stand-in process killed with signal 9, as the kernel's
    out-of-memory killer does) is one UserError naming the status; to a poller it is still an OSError."""
    server = ServerProcess.__new__(ServerProcess)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        server.host = f"127.0.0.1:{s.getsockname()[1]}"
    server.log = tmp_path / "server.log"
    server.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    server.proc.kill()
    server.proc.wait()
    with pytest.raises(UserError, match=r"status -9 \(killed: out of memory\?\); its log: .*server\.log"):
        server.metrics()
    with pytest.raises(OSError):
        server.get("/health")
