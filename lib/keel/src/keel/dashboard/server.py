"""Serve the dashboard on 127.0.0.1, or write it as static files to share.

The page is index.html, static/app.js and static/style.css (package data), and state.js: the state
document as `window.KEEL_STATE`. Served live, state.js and state.json are rebuilt from the prefix
on request (at most once a second, however many tabs poll, and less often where a build is slow),
and the page polls state.json;
exported, state.js is a snapshot and the page opens from disk with no server.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

from keel.dashboard.state import build_state
from keel.executor import storage
from keel.spec.metrics import finite_json

HOST = "127.0.0.1"
STATIC = ("app.js", "style.css")
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".json": "application/json"}
FRESH_S = 1.0
BUILDS_SHARE = 0.2
"""At most this share of a core on building the state: a build that took 2 s waits 10 s for the next."""


def _static(name: str) -> bytes:
    return resources.files("keel.dashboard").joinpath("static", name).read_bytes()


def _state_json(state: dict) -> str:
    return json.dumps(finite_json(state), default=str)


def state_script(state_json: str, live: bool) -> str:
    return f"window.KEEL_LIVE = {'true' if live else 'false'};\nwindow.KEEL_STATE = {state_json};\n"


class _Cached:
    """The state document as JSON, rebuilt when older than FRESH_S, or than its last build's time
    over BUILDS_SHARE where that is longer: a large run's state is read from the prefix and encoded
    once per build, not once per poll, and a slow build does not follow another at once."""

    def __init__(self, experiment: str, graph):
        self.experiment, self.graph = experiment, graph
        self._lock = threading.Lock()
        self._json, self._at, self._took = None, 0.0, 0.0

    def get(self) -> str:
        with self._lock:
            if self._json is None or time.monotonic() - self._at > max(FRESH_S, self._took / BUILDS_SHARE):
                started = time.monotonic()
                self._json = _state_json(build_state(self.experiment, self.graph))
                self._at = time.monotonic()
                self._took = self._at - started
            return self._json


def _local_hosts(port: int) -> set[str]:
    """The Host headers a browser sends for this server: host:port, or the bare host on port 80,
    whose port browsers leave out."""
    names = ("127.0.0.1", "localhost")
    return {f"{name}:{port}" for name in names} | (set(names) if port == 80 else set())


def make_server(experiment: str, graph, port: int = 0) -> ThreadingHTTPServer:
    """A server for the page on 127.0.0.1:`port` (0: a free port; read `server.server_port`)."""
    cached = _Cached(experiment, graph)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.headers.get("Host") not in _local_hosts(self.server.server_address[1]):
                # a page elsewhere whose name resolves here (DNS rebinding) must not read the run's state
                self.send_error(403, explain="keel dashboard answers requests for 127.0.0.1 or localhost only")
                return
            path = self.path.split("?", 1)[0]
            try:
                self._route(path)
            except Exception as exc:  # noqa: BLE001 - a prefix mid-write or a record of another version: say so, keep serving
                print(f"keel dashboard: {self.path}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                if path == "/state.json":  # the page says it, over the last state it drew
                    self._send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode(), ".json", status=500)
                else:
                    self.send_error(500, explain=f"{type(exc).__name__}: {exc}")

        def _route(self, path: str) -> None:
            if path in ("/", "/index.html"):
                self._send(_static("index.html"), ".html")
            elif path == "/state.js":
                self._send(state_script(cached.get(), live=True).encode(), ".js")
            elif path == "/state.json":
                self._send(cached.get().encode(), ".json")
            elif path.startswith("/static/") and path[len("/static/"):] in STATIC:
                self._send(_static(path[len("/static/"):]), os.path.splitext(path)[1])
            else:
                self.send_error(404)

        def _send(self, body: bytes, kind: str, status: int = 200) -> None:
            self.send_response(status)
            self.send_header("Content-Type", f"{_TYPES[kind]}; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # one line per poll would bury the command's own output
            pass

    server = ThreadingHTTPServer((HOST, port), Handler)
    server.daemon_threads = True
    return server


def serve(experiment: str, graph, port: int) -> int:
    """`keel dashboard EXP.py --port N`: serve until Ctrl-C; exit code 2 when the port is taken."""
    try:
        server = make_server(experiment, graph, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            print(f"keel: error: port {port} is in use (another keel dashboard?): pass --port {_free_port()} or --port 0",
                  file=sys.stderr)
        else:  # a port below 1024 without the right to bind it, ...
            print(f"keel: error: --port {port}: cannot listen on {HOST}:{port} ({exc.strerror or exc}): pass --port "
                  f"{_free_port()} or --port 0", file=sys.stderr)
        return 2
    try:
        print(f"keel dashboard of {experiment}: http://{HOST}:{server.server_port}/  (Ctrl-C stops it)", flush=True)
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _free_port() -> int:
    """A port free on 127.0.0.1 now, to suggest in place of a taken one."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def export(experiment: str, graph, out_dir: str) -> str:
    """`keel dashboard EXP.py --out DIR`: the page as static files (open DIR/index.html) in any
    fsspec folder (local, gs://, s3://, memory://); returns its path."""
    for name in STATIC:
        storage.write_atomic(storage.join(out_dir, "static", name), _static(name))
    storage.write_atomic(storage.join(out_dir, "state.js"), state_script(_state_json(build_state(experiment, graph)), live=False))
    index = storage.join(out_dir, "index.html")
    storage.write_atomic(index, _static("index.html"))
    return index
