"""A fault-injecting HTTP proxy on loopback, in front of an S3 server (moto's, tests/s3_server.py).

Point a client at it with AWS_ENDPOINT_URL=http://127.0.0.1:<port>; it forwards every request
to the server unchanged, except those a rule picks, which meet one of the faults an object
store has on a busy day, before the request reaches the server (so the store is unchanged and a
retry is the whole cure):

    503      503 SlowDown, "Please reduce your request rate" (S3's throttling)
    500      500 InternalError
    timeout  no answer for `delay` seconds (set it past the client's read timeout), then closed
    reset    the connection reset (RST) without an answer
    slow     forwarded after `delay` seconds (a request the store is slow to serve)
    lost     forwarded, then the connection reset: the store did it, its answer never came
    400timeout  400 RequestTimeout (the server gave up waiting on the client's socket)
    baddigest   400 BadDigest (the body's checksum did not match: damaged on the way)
    cut      the connection reset before the request's body is read (a reset while sending)

A rule (`Rule`) picks requests by a regular expression over "METHOD /bucket/key?query" (GETs
of DCP shards, PUTs of parts, the POSTs that start and complete a multipart upload...; a
server-side copy has " copy-from=/bucket/key" appended (its x-amz-copy-source), a bulk delete
" delete=key1,key2,..." (the keys its body names)) and
fires on every n-th match or at random with probability `rate` (seeded), at most `limit`
times, cycling through its kinds. Rules can be replaced while the proxy runs (`set_rules`);
`stats()` counts what was injected, by kind and by rule. `ignore_conditions` drops the
If-Match / If-None-Match headers on the way, as a store that ignores conditional writes does
(GCS's S3 API, MinIO before 2025).

    python scripts/s3_fault_proxy.py --upstream http://127.0.0.1:5000 --port 5001 \\
        --match '^(PUT|POST) ' --rate 0.2 --kinds 503,500,reset,timeout --delay 3
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import random
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

KINDS = ("503", "500", "timeout", "reset")  # the faults a store's own retries cure
MORE = ("slow", "lost", "cut", "400timeout", "baddigest")  # also transient, less common
HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "expect",
    "proxy-connection",
    "te",
    "upgrade",
    "content-length",
}
_ERRORS = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "400timeout": (
        400,
        "RequestTimeout",
        "Your socket connection to the server was not "
        "read from or written to within the timeout period.",
    ),
    "baddigest": (
        400,
        "BadDigest",
        "The Content-MD5 you specified did not match what we received.",
    ),
}


@dataclass
class Rule:
    match: str = "."  # re.search over "METHOD /bucket/key?query[ copy-from=...]"
    kinds: tuple = KINDS  # cycled through, one per injected fault
    every: int = 0  # fire on every n-th matching request (0: use rate)
    rate: float = 0.0  # else fire with this probability
    limit: int = 1 << 30  # at most this many faults
    seed: int = 0
    seen: int = 0
    fired: int = 0
    _rng: random.Random = field(default=None, repr=False)

    def fires(self, line: str) -> str | None:
        """The fault for this request, or None (and count it)."""
        if not re.search(self.match, line) or self.fired >= self.limit:
            return None
        self.seen += 1
        if self._rng is None:
            self._rng = random.Random(self.seed)
        hit = self.seen % self.every == 0 if self.every else self._rng.random() < self.rate
        if not hit:
            return None
        kind = self.kinds[self.fired % len(self.kinds)]
        self.fired += 1
        return kind


class FaultProxy:
    """The proxy, served by threads of this process (`start`, `stop`)."""

    def __init__(
        self, upstream: str, delay: float = 3.0, port: int = 0, ignore_conditions: bool = False
    ):
        u = urlsplit(upstream)
        self.upstream, self.delay = (u.hostname, u.port), float(delay)
        self.ignore_conditions = ignore_conditions
        self.rules: list[Rule] = []
        self.injected: dict[str, int] = dict.fromkeys((*KINDS, *MORE), 0)
        self.log: list[str] = []  # "kind METHOD path" per injected fault
        self.requests = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self.server = _Server(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> "FaultProxy":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def set_rules(self, *rules: Rule) -> None:
        with self.lock:
            self.rules = list(rules)

    def stats(self) -> dict:
        with self.lock:
            return {
                "requests": self.requests,
                "injected": dict(self.injected),
                "total": sum(self.injected[k] for k in KINDS),
                "rules": [(r.match, r.seen, r.fired) for r in self.rules],
            }

    def pick(self, line: str) -> str | None:
        with self.lock:
            self.requests += 1
            for rule in self.rules:
                kind = rule.fires(line)
                if kind is not None:
                    self.injected[kind] += 1
                    self.log.append(f"{kind} {line}")
                    return kind
        return None


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client that gave up on an answer (its own timeout) closed the connection: the
        write of the answer fails; nothing to report."""


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and 100-continue for large PUTs
    owner: FaultProxy

    def log_message(self, *args) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _any(self) -> None:
        line = f"{self.command} {self.path}"
        if self.headers.get("x-amz-copy-source"):
            line += f" copy-from={self.headers['x-amz-copy-source']}"
        if self.command == "POST" and "?delete" in self.path:  # the keys are in its body
            body = self._body()
            line += " delete=" + ",".join(re.findall(r"<Key>([^<]*)</Key>", body.decode()))
        else:
            body = None
        kind = self.owner.pick(line)
        if kind == "cut":
            self._reset()
            return
        if body is None:
            body = self._body()
        if kind in _ERRORS:
            status, code, message = _ERRORS[kind]
            xml = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>"
            ).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(xml)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(xml)
            return
        if kind == "timeout":
            time.sleep(self.owner.delay)
            self.close_connection = True
            return
        if kind == "reset":
            self._reset()
            return
        if kind == "slow":
            time.sleep(self.owner.delay)
        self._forward(body, answer=kind != "lost")
        if kind == "lost":
            self._reset()

    def _reset(self) -> None:
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True

    def _forward(self, body: bytes, answer: bool = True) -> None:
        conn = http.client.HTTPConnection(*self.owner.upstream, timeout=120)
        dropped = HOP | ({"if-match", "if-none-match"} if self.owner.ignore_conditions else set())
        headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if not answer:
            return
        self.send_response_only(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in HOP:
                self.send_header(k, v)
        length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
        if length is not None and resp.status not in (204, 304):
            self.send_header("Content-Length", length)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--upstream", required=True, help="the S3 server, http://host:port")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--match", default=".")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--rate", type=float, default=0.1)
    p.add_argument("--every", type=int, default=0)
    p.add_argument("--delay", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    proxy = FaultProxy(a.upstream, a.delay, a.port).start()
    proxy.set_rules(Rule(a.match, tuple(a.kinds.split(",")), a.every, a.rate, seed=a.seed))
    print(f"fault proxy on {proxy.url} -> {a.upstream}", flush=True)
    try:
        while True:
            time.sleep(10)
            print(proxy.stats(), flush=True)
    except KeyboardInterrupt:
        proxy.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
