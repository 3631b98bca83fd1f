"""The HTTP endpoint Prometheus scrapes: prometheus_client's WSGI server on a
daemon thread, with a handle that stops it."""
from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import CollectorRegistry

from tierstore.errors import ArgumentTypeError, SettingError

DEFAULT_ADDR = "127.0.0.1"  # loopback: exposing metrics on other interfaces is an explicit choice


def check_endpoint(port, addr) -> None:
    """Raise TypeError/ValueError for a port or address that cannot be bound."""
    if not isinstance(port, int) or isinstance(port, bool):
        raise ArgumentTypeError(f"metrics port must be an int (0 picks a free port), got {port!r}")
    if not 0 <= port <= 65535:
        raise SettingError(f"metrics port must be in 0..65535 (0 picks a free port), got {port}")
    if not isinstance(addr, str) or not addr:
        raise ArgumentTypeError(f"metrics addr must be a host address string such as '127.0.0.1', got {addr!r}")


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # a scrape every few seconds must not fill stderr
        pass


class MetricsServer:
    """Serves ``registry`` in the Prometheus text format at http://addr:port/metrics.

    ``port=0`` binds a free port; read it back from ``.port``. ``close()``
    stops the server and frees the port; it is idempotent.
    """

    def __init__(self, registry: CollectorRegistry, port: int = 0, addr: str = DEFAULT_ADDR):
        check_endpoint(port, addr)
        try:
            # like prometheus_client.start_http_server, but polling for shutdown every
            # 50 ms (not 500), so that closing a store does not stall on its endpoint
            family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            server_class = type("_Server", (ThreadingWSGIServer,), {"address_family": family})  # IPv6 addresses too
            self._httpd = make_server(sockaddr[0], port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
        except OSError as e:
            raise OSError(
                e.errno,
                f"cannot serve metrics on {addr}:{port} ({e.strerror or e}); choose another metrics port, "
                "or 0 for a free one (stores sharing a registry can share one endpoint)",  # whichever option set it
            ) from e
        self.addr = addr
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name=f"tierstore-metrics:{self.port}", daemon=True
        )
        self._thread.start()
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._httpd.shutdown()  # waits for serve_forever to return
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsServer({self.url!r}{', closed' if self._closed else ''})"
