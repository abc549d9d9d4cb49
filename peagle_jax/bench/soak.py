"""``python -m peagle_jax.bench.soak``: a bounded soak of the server under mixed, partly hostile traffic.

It starts one ``python -m peagle_jax.serve`` (``--compile first``: every graph is compiled before traffic),
then for ``--seconds`` runs ``--clients`` threads (default 2x ``--max-batch``), each sending one request
after another:

- about 80% valid requests: completions and chat, streamed or not, greedy ones drawn from a small pool of
  fixed requests and seeded sampling ones with random prompts and ``max_tokens``;
- about 10% disconnects at a random moment: mid-stream, before the answer and mid-body, streamed or not;
- about 10% bad requests: malformed JSON, random bytes, wrong types, huge ``max_tokens``, an unknown model,
  deeply nested JSON, garbage on the socket instead of HTTP, and a valid request whose body arrives one
  byte at a time (that one must be answered normally).

Beside them a thread polls ``/health`` every 0.25 s and times it, and another samples the server's RSS
(``/proc/PID/status``). Invariants (any failure: exit status 1, and the summary says which):

- no 5xx and no error event in a stream; valid requests answered 200 (429 is allowed: the queue was full),
  bad bodies 4xx (garbage on the socket: any answer but a 5xx, or none), no client error on a valid request;
- no ``Traceback`` in the server log, and the server exits 0 on SIGTERM;
- after the traffic stops, ``/metrics`` returns to idle (no active slot, an empty queue) within 30 s;
- every ``/health`` poll answered 200 within 1 s;
- every completed greedy answer equals the answer its request gets alone on the idle server afterwards;
- the RSS grows by less than ``--max-rss-growth-mib`` from the middle of the traffic to its end.

Prints a markdown summary; ``--json FILE`` writes it with every count and the RSS samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import random
import shlex
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from peagle_jax import errors
from peagle_jax.bench.server import ServerProcess
from peagle_jax.errors import UserError

READY_TIMEOUT_S = 3600.0  # the server's start-up, every graph compiled first
HEALTH_EVERY_S = 0.25
HEALTH_BOUND_S = 1.0
IDLE_WITHIN_S = 30.0
RSS_EVERY_S = 0.5
GREEDY_POOL = 6
TIMEOUT_S = 300.0  # one request, however slow the machine
WORDS = "the sea a robot river light quiet story seven why green moon tell me about write city old fast".split()
BAD_VARIANTS = (
    "malformed_json",
    "random_bytes",
    "wrong_types",
    "huge_max_tokens",
    "unknown_model",
    "deeply_nested",
    "garbage_http",
    "slow_body",
)
DISCONNECT_VARIANTS = ("mid_stream", "before_answer", "mid_body")


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="model to serve (default: the embedded smollm2)")
    p.add_argument(
        "--serve-args",
        default="",
        help="more server flags, one shell-quoted string, e.g. --serve-args='--k 0 --dtype bfloat16'",
    )
    p.add_argument("--seconds", type=float, default=300, help="seconds of traffic (default 300)")
    p.add_argument("--clients", type=int, help="client threads (default 2x --max-batch)")
    p.add_argument("--max-batch", type=int, default=4, help="the server's slots (default 4)")
    p.add_argument("--max-seq-len", type=int, default=256, help="the server's context per request (default 256)")
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic (default 0)")
    p.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=200,
        help="largest allowed RSS growth over the second half of the traffic (default 200)",
    )
    p.add_argument("--json", help="write the summary to this file")
    return p


@dataclasses.dataclass(frozen=True)
class Action:
    """One thing a client does: ``kind`` is 'request', 'disconnect' or 'bad'; ``greedy`` indexes the greedy
    pool (its answer is checked) or is None."""

    kind: str
    variant: str
    path: str
    body: bytes
    stream: bool = False
    greedy: int | None = None


def _prompt(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _body(model: str, chat: bool, prompt: str, **kw) -> dict:
    key = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    return {"model": model, **key, **kw}


def greedy_pool(seed: int, model: str, max_seq_len: int) -> list[tuple[str, dict]]:
    """``GREEDY_POOL`` distinct greedy requests (path, body without ``stream``), completions and chat."""
    rng = random.Random(seed)
    pool = []
    for i in range(GREEDY_POOL):
        chat = i % 2 == 1
        n = rng.randint(max(2, max_seq_len // 16), max_seq_len // 4)
        body = _body(model, chat, f"{i}: {_prompt(rng, 3 + i)}", max_tokens=n, temperature=0)
        pool.append(("/v1/chat/completions" if chat else "/v1/completions", body))
    return pool


def plan(rng: random.Random, pool: list[tuple[str, dict]], model: str, max_seq_len: int) -> Action:
    """The next action of a client (see the module docstring for the mix)."""
    r = rng.random()
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if r < 0.1:
        variant = rng.choice(DISCONNECT_VARIANTS)
        stream = variant == "mid_stream" or rng.random() < 0.5
        body = _body(model, chat, _prompt(rng, 4), max_tokens=max_seq_len // 3, temperature=0.8, stream=stream)
        return Action("disconnect", variant, path, json.dumps(body).encode(), stream=stream)
    if r < 0.2:
        return bad_action(rng, rng.choice(BAD_VARIANTS), pool, model)
    stream = rng.random() < 0.5
    if rng.random() < 0.5:
        g = rng.randrange(len(pool))
        gpath, body = pool[g]
        return Action("request", "greedy", gpath, json.dumps({**body, "stream": stream}).encode(), stream, g)
    body = _body(
        model,
        chat,
        _prompt(rng, rng.randint(1, 10)),
        max_tokens=rng.randint(1, max_seq_len // 4),
        temperature=round(rng.uniform(0.2, 1.5), 2),
        top_p=rng.choice([1.0, 0.9]),
        seed=rng.randrange(2**32),
        stream=stream,
    )
    return Action("request", "sampled", path, json.dumps(body).encode(), stream)


def bad_action(rng: random.Random, variant: str, pool: list[tuple[str, dict]], model: str) -> Action:
    path = rng.choice(["/v1/completions", "/v1/chat/completions", "/invocations"])
    bodies = {
        "malformed_json": lambda: b'{"model": "' + model.encode() + b'", "prompt": "x"',
        "random_bytes": lambda: rng.randbytes(rng.randint(1, 2000)),
        "wrong_types": lambda: json.dumps(
            rng.choice(
                [
                    {"model": model, "prompt": "x", "max_tokens": "5"},
                    {"model": model, "prompt": 7},
                    {"model": model, "messages": "hi"},
                    {"model": model, "prompt": "x", "temperature": [1]},
                    {"model": model, "prompt": "x", "stream": "yes"},
                ]
            )
        ).encode(),
        "huge_max_tokens": lambda: json.dumps({"model": model, "prompt": "x", "max_tokens": 10**12}).encode(),
        "unknown_model": lambda: json.dumps(
            _body(model + "-nope", path.endswith("chat/completions"), "x", max_tokens=2)
        ).encode(),
        "deeply_nested": lambda: b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "garbage_http": lambda: rng.choice(GARBAGE_HTTP)(rng),
    }
    if variant == "slow_body":
        g = rng.randrange(len(pool))
        gpath, body = pool[g]
        return Action("bad", variant, gpath, json.dumps(body).encode(), greedy=g)
    return Action("bad", variant, path, bodies[variant]())


# Bytes that are not a well-formed HTTP request (or not only one), for the raw socket; the client then ends
# its input (a half close), so the server never waits for more.
GARBAGE_HTTP = (
    lambda rng: rng.randbytes(rng.randint(1, 512)) + b"\r\n\r\n",
    lambda rng: b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + rng.randbytes(64) + b"\r\n\r\n",  # a TLS hello
    lambda rng: b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    lambda rng: b"GET /\x00\xff HTTP/1.1\r\nHost: x\r\n\r\n",
    lambda rng: b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
    lambda rng: b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 70_000 + b"\r\n\r\n",
    lambda rng: b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    lambda rng: b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    lambda rng: b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
    lambda rng: b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n\r\n",
    lambda rng: (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    lambda rng: b"BREW /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n",
    lambda rng: b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
    lambda rng: b"GET /%ff%00%c3%28 HTTP/1.1\r\nHost: x\r\n\r\n",
    lambda rng: b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n",
    lambda rng: b"GET http://elsewhere.example/health HTTP/1.1\r\nHost: x\r\n\r\n",
    lambda rng: b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n\x00\x01garbage after a request\r\n\r\n",
    lambda rng: (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"model"'
    ),  # a body shorter than declared, then the end of input
    lambda rng: (
        b"GET /health HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ),
)


def request_bytes(path: str, body: bytes, extra: str = "") -> tuple[bytes, bytes]:
    """(head, body) of one HTTP/1.1 POST that asks the server to close the connection after answering."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode(), body


def read_response(sock: socket.socket) -> tuple[int | None, bytes]:
    """(status, body) of the response on ``sock``; (None, b'') if the server closed without answering."""
    r = http.client.HTTPResponse(sock)
    try:
        r.begin()
    except (http.client.HTTPException, ConnectionError):
        return None, b""
    return r.status, r.read()


def parse_answer(raw: bytes, stream: bool) -> tuple[str, str | None, bool]:
    """(text, finish_reason, error event seen) of a 200 answer, plain JSON or server-sent events (a stream
    without its final ``data: [DONE]`` has finish_reason None)."""
    if not stream:
        choice = json.loads(raw)["choices"][0]
        return choice.get("text", choice.get("message", {}).get("content")), choice["finish_reason"], False
    events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    done = bool(events) and events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events if e != "[DONE]"]
    if any("error" in o for o in objs):
        return "", None, True
    text = "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or "" for c in objs)
    finish = objs[-1]["choices"][0]["finish_reason"] if objs and done else None
    return text, finish, False


def execute(action: Action, port: int, rng: random.Random) -> dict:
    """Do ``action`` on a fresh connection; returns its record (kind, variant, status, outcome, and for an
    answered request its text and finish reason)."""
    rec = {"kind": action.kind, "variant": action.variant, "status": None, "greedy": action.greedy}
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as s:
            if action.variant == "garbage_http":
                s.settimeout(30)
                s.sendall(action.body)
                s.shutdown(socket.SHUT_WR)  # the end of input: the server cannot wait for more
                rec["status"] = read_response(s)[0]
                return rec
            head, body = request_bytes(action.path, action.body)
            if action.variant == "mid_body":  # the client goes before its body is complete
                s.sendall(head + body[: rng.randrange(len(body))])
                time.sleep(rng.uniform(0, 0.5))
                return rec
            if action.variant == "slow_body":
                s.sendall(head)
                for i in range(len(body)):
                    s.sendall(body[i : i + 1])
                    time.sleep(0.01)
            else:
                s.sendall(head + body)
            if action.variant == "before_answer":
                time.sleep(rng.uniform(0, 1.0))
                return rec
            if action.variant == "mid_stream":
                s.settimeout(TIMEOUT_S)
                s.recv(rng.choice([1, 200, 2000]))  # the head, maybe some events, then the client goes
                time.sleep(rng.uniform(0, 0.5))
                return rec
            rec["status"], raw = read_response(s)
    except (ConnectionError, TimeoutError, OSError) as err:
        rec["client_error"] = type(err).__name__
        return rec
    if rec["status"] == 200 and action.kind != "disconnect":
        rec["text"], rec["finish"], rec["error_event"] = parse_answer(raw, action.stream)
    return rec


def check_record(rec: dict) -> str | None:
    """What is wrong with one record, or None."""
    status, kind, variant = rec["status"], rec["kind"], rec["variant"]
    if status is not None and status >= 500:
        return f"{kind} {variant}: status {status}"
    if rec.get("error_event"):
        return f"{kind} {variant}: an error event in the stream"
    if kind == "disconnect":
        return None
    if "client_error" in rec:
        if kind == "bad" and variant not in ("slow_body",):
            return None  # the server may close a hostile connection before the client is done sending
        return f"{kind} {variant}: client error {rec['client_error']}"
    valid = kind == "request" or variant == "slow_body"
    if valid and status not in (200, 429):
        return f"{kind} {variant}: status {status}"
    if valid and status == 200 and rec.get("finish") is None:
        return f"{kind} {variant}: the answer has no finish_reason"
    if variant == "garbage_http":
        return None  # any answer but a 5xx (some garbage still parses as a request), or none
    if not valid and not 400 <= (status or 0) < 500:
        return f"{kind} {variant}: status {status}, expected a 4xx"
    return None


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered))) - 1))]


def proc_status_mib(pid: int, field: str) -> float | None:
    """``VmRSS`` / ``VmHWM`` of a process in MiB (None where /proc is not there)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Sampler(threading.Thread):
    """Calls ``sample()`` every ``every`` seconds until :meth:`stop`; keeps (seconds since start, value)."""

    def __init__(self, sample, every: float):
        super().__init__(daemon=True)
        self.sample, self.every = sample, every
        self.values: list[tuple[float, object]] = []
        self._done = threading.Event()
        self.t0 = time.monotonic()

    def run(self):
        while not self._done.is_set():
            t = time.monotonic()
            self.values.append((t - self.t0, self.sample()))
            self._done.wait(max(0.0, self.every - (time.monotonic() - t)))

    def stop(self):
        self._done.set()
        self.join()


def health_probe(server: ServerProcess):
    def probe() -> tuple[int | None, float]:
        t = time.perf_counter()
        try:
            status = server.get("/health", timeout=10)[0]
        except OSError:
            status = None
        return status, time.perf_counter() - t

    return probe


def run_traffic(args, port: int, pool) -> list[dict]:
    """``args.clients`` threads doing :func:`plan`'s actions until ``args.seconds`` have passed."""
    records: list[dict] = []
    lock = threading.Lock()
    deadline = time.monotonic() + args.seconds

    def client(i: int):
        rng = random.Random(args.seed * 1_000_003 + i)
        while time.monotonic() < deadline:
            rec = execute(plan(rng, pool, args.model_name, args.max_seq_len), port, rng)
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def wait_idle(server: ServerProcess, timeout: float) -> tuple[float | None, dict]:
    """Seconds until no slot is active and the queue is empty (None: not within ``timeout``), and the last
    metrics read."""
    t0 = time.monotonic()
    while True:
        m = server.metrics()
        if m["peagle_active_slots"] == 0 and m["peagle_queue_depth"] == 0:
            return round(time.monotonic() - t0, 2), m
        if time.monotonic() - t0 > timeout:
            return None, m
        time.sleep(0.1)


def replay_greedy(port: int, pool, records: list[dict]) -> tuple[int, list[str]]:
    """Send each greedy request of ``pool`` alone; compare every completed greedy answer in ``records`` with
    it. Returns (answers compared, mismatches)."""
    alone, bad = [], []
    for path, body in pool:
        rec = execute(Action("request", "greedy", path, json.dumps(body).encode()), port, random.Random(0))
        if rec["status"] != 200:
            bad.append(f"the single request {body} answered {rec['status']}")
        alone.append((rec.get("text"), rec.get("finish")))
    checked = 0
    for rec in records:
        if rec["greedy"] is None or rec["status"] != 200 or rec.get("finish") is None:
            continue
        checked += 1
        if (rec["text"], rec["finish"]) != alone[rec["greedy"]]:
            bad.append(
                f"greedy request {rec['greedy']} ({rec['variant']}): {rec['text']!r} != {alone[rec['greedy']]!r}"
            )
    return checked, bad


def summarize(records: list[dict]) -> dict:
    """Counts by kind and variant, and by status ('closed' / 'client error' where there was none)."""
    by: dict[str, dict[str, int]] = {}
    statuses: dict[str, int] = {}
    for rec in records:
        status = str(rec["status"]) if rec["status"] else "client error" if "client_error" in rec else "closed"
        if rec["kind"] == "disconnect":
            status = "disconnected"
        row = by.setdefault(f"{rec['kind']} {rec['variant']}", {})
        row[status] = row.get(status, 0) + 1
        statuses[status] = statuses.get(status, 0) + 1
    return {
        "actions": len(records),
        "by_action": dict(sorted(by.items())),
        "by_status": dict(sorted(statuses.items())),
        "disconnects": sum(r["kind"] == "disconnect" for r in records),
        "bad_requests": sum(r["kind"] == "bad" for r in records),
        "completed_requests": sum(r["kind"] == "request" and r["status"] == 200 for r in records),
    }


def rss_at(samples: list[tuple[float, float]], frac: float, start: float, seconds: float) -> float | None:
    """The RSS sample nearest to ``frac`` of the traffic (which ran from ``start`` for ``seconds``)."""
    if not samples:
        return None
    return min(samples, key=lambda s: abs(s[0] - (start + frac * seconds)))[1]


def render(result: dict) -> str:
    c, h, r = result["counts"], result["health"], result["rss_mib"]
    lines = [
        f"Soak: {result['config']['model']}, {result['config']['clients']} clients for "
        f"{result['config']['seconds']:.0f} s; {c['actions']} actions, {c['completed_requests']} requests completed, "
        f"{c['disconnects']} disconnects, {c['bad_requests']} bad requests",
        "",
        "| action | outcomes |",
        "|---|---|",
    ]
    for name, row in c["by_action"].items():
        lines.append(f"| {name} | {', '.join(f'{k}: {v}' for k, v in row.items())} |")
    lines += [
        "",
        f"By status: {', '.join(f'{k}: {v}' for k, v in c['by_status'].items())}",
        f"/health: {h['polls']} polls, p50 {h['p50_ms']:.1f} ms, p99 {h['p99_ms']:.1f} ms, max {h['max_ms']:.1f} ms, "
        f"{h['late_or_failed']} late or failed",
        f"RSS (MiB): at 25% {_mib(r['at_25'])}, at 50% {_mib(r['at_50'])}, at the end {_mib(r['end'])}, "
        f"peak {_mib(r['peak'])} (VmHWM {_mib(r['hwm'])}); growth over the second half {_mib(r['growth'])}",
        f"Greedy answers checked against their single-request answers: {result['greedy']['checked']} "
        f"({result['greedy']['distinct']} distinct requests), {len(result['greedy']['mismatches'])} mismatches",
        f"Idle after the traffic within {result['idle_after_s']} s; server exit status {result['exit_status']}",
        "",
        "| invariant | result |",
        "|---|---|",
    ]
    for name, problem in result["invariants"].items():
        lines.append(f"| {name} | {'ok' if problem is None else 'FAILED: ' + problem} |")
    return "\n".join(lines)


def _mib(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def check_args(args) -> list[str]:
    """Refuse bad flags (a :class:`UserError`); returns the extra server flags."""
    for flag, value, low in (
        ("--seconds", args.seconds, 1),
        ("--max-batch", args.max_batch, 1),
        ("--max-seq-len", args.max_seq_len, 128),
    ):
        if value < low:
            raise UserError(f"{flag} must be >= {low}, got {value:g}")
    if args.clients is not None and args.clients < 1:
        raise UserError(f"--clients must be >= 1, got {args.clients}")
    try:
        extra = shlex.split(args.serve_args)
    except ValueError as err:
        raise UserError(f"--serve-args {args.serve_args!r}: {err}") from None
    for flag in ("--port", "--host", "--api-key", "--compile", "--max-batch", "--max-seq-len", "--model"):
        if any(a == flag or a.startswith(flag + "=") for a in extra):
            raise UserError(f"--serve-args: {flag} is set by the soak itself")
    return extra


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        extra = check_args(args)
    except UserError as err:
        return errors.report(err)
    args.clients = args.clients or 2 * args.max_batch
    log = Path(tempfile.mkdtemp(prefix="peagle-soak-")) / "server.log"
    print(f"starting the server (log: {log})", file=sys.stderr, flush=True)
    flags = ["--model", args.model, "--max-batch", str(args.max_batch), "--max-seq-len", str(args.max_seq_len)]
    server = ServerProcess([*flags, "--compile", "first", *extra], log)
    try:
        try:
            server.wait_ready(READY_TIMEOUT_S, all_graphs=True)
        except UserError as err:
            return errors.report(err)
        args.model_name = server.model_id()
        result = soak(args, server)
    finally:
        exit_status = server.stop()
    result["exit_status"] = exit_status
    inv = result["invariants"]
    inv["exits 0 on SIGTERM"] = None if exit_status == 0 else f"exit status {exit_status}"
    text = log.read_text(errors="replace")
    inv["no traceback in the log"] = None if "Traceback" not in text else f"see {log}"
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    failed = [name for name, problem in inv.items() if problem is not None]
    if failed:
        print(f"error: invariants failed: {', '.join(failed)} (server log: {log})", file=sys.stderr)
        return 1
    return 0


def soak(args, server: ServerProcess) -> dict:
    """The traffic, the samplers, the idle wait and the greedy replay; the result without the exit checks."""
    pool = greedy_pool(args.seed, args.model_name, args.max_seq_len)
    health = Sampler(health_probe(server), HEALTH_EVERY_S)
    rss = Sampler(lambda: proc_status_mib(server.proc.pid, "VmRSS"), RSS_EVERY_S)
    health.start()
    rss.start()
    start = time.monotonic() - rss.t0
    print(f"traffic: {args.clients} clients for {args.seconds:g} s", file=sys.stderr, flush=True)
    records = run_traffic(args, server.port, pool)
    idle_s, _ = wait_idle(server, IDLE_WITHIN_S)
    health.stop()
    checked, mismatches = replay_greedy(server.port, pool, records)
    final = server.metrics()
    rss.stop()
    hwm = proc_status_mib(server.proc.pid, "VmHWM")

    lat = [t for _, (status, t) in health.values]
    late = [
        (round(at, 2), status, round(t, 3)) for at, (status, t) in health.values if status != 200 or t > HEALTH_BOUND_S
    ]
    samples = [(t, v) for t, v in rss.values if v is not None]
    at_25, at_50 = (rss_at(samples, f, start, args.seconds) for f in (0.25, 0.5))
    end = rss_at(samples, 1.0, start, args.seconds)
    growth = None if at_50 is None else end - at_50
    problems = [p for p in map(check_record, records) if p]
    counts = summarize(records)
    invariants = {
        "no 5xx, valid requests answered, bad ones refused": None
        if not problems
        else f"{len(problems)} problems, e.g. {problems[:3]}",
        "idle within 30 s after the traffic": None if idle_s is not None else "slots or queue still busy",
        "/health always 200 within 1 s": None if not late else f"{len(late)} polls, e.g. {late[:3]}",
        "greedy answers equal single requests": None if not mismatches else "; ".join(mismatches[:3]),
        f"RSS growth < {args.max_rss_growth_mib:g} MiB": None
        if growth is None or growth < args.max_rss_growth_mib
        else f"grew {growth:.0f} MiB",
    }
    return {
        "config": {
            "model": args.model,
            "serve_args": args.serve_args,
            "seconds": args.seconds,
            "clients": args.clients,
            "max_batch": args.max_batch,
            "max_seq_len": args.max_seq_len,
            "seed": args.seed,
        },
        "counts": counts,
        "problems": problems,
        "health": {
            "polls": len(lat),
            "p50_ms": percentile(lat, 50) * 1e3,
            "p99_ms": percentile(lat, 99) * 1e3,
            "max_ms": max(lat, default=0) * 1e3,
            "late_or_failed": len(late),
        },
        "rss_mib": {
            "at_25": at_25,
            "at_50": at_50,
            "end": end,
            "peak": max((v for _, v in samples), default=None),
            "hwm": hwm,
            "growth": growth,
            "samples": [(round(t, 2), round(v, 1)) for t, v in samples],
        },
        "greedy": {"distinct": len(pool), "checked": checked, "mismatches": mismatches},
        "idle_after_s": idle_s,
        "server_requests_total": {k: v for k, v in final.items() if k.startswith("peagle_requests_total")},
        "invariants": invariants,
    }


if __name__ == "__main__":
    sys.exit(main())
