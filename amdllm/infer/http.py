"""The HTTP side of `amdllm serve`: uvicorn's h11 protocol with the two guards it lacks, and the socket.

uvicorn holds a connection that sends its request slowly, or never, forever. Here a request must arrive
whole within `request_timeout` seconds of its first byte, or the connection is closed; past
`max_connections` open connections a new one takes the place of the oldest that has sent nothing yet,
or is closed at once if none is silent (and requests beyond that many in flight get uvicorn's 503). The protocol needs the [serve] extra (uvicorn); the socket helpers do not."""
from __future__ import annotations

import resource
import socket
import time

REQUEST_TIMEOUT_S = 30.0  # an 8 MiB body (the cap) arrives in well under this on any real link
MAX_CONNECTIONS = 512


def guarded_protocol(request_timeout: float = REQUEST_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS):
    """uvicorn's H11Protocol with a deadline on receiving each request and a cap on open connections."""
    import h11  # uvicorn's HTTP parser: the [serve] extra, imported when a server starts
    from uvicorn.protocols.http.h11_impl import H11Protocol  # the same extra

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._started, self._timer, self._silent = time.monotonic(), None, True
            if len(self.connections) > max_connections:
                # full: the oldest connection that has sent nothing gives way (idle sockets must not lock
                # clients out until they time out); if every one has a request under way, this one goes
                silent = [c for c in self.connections if c is not self and getattr(c, "_silent", False)]
                victim = min(silent, key=lambda c: c._started) if silent else self
                victim.transport.close()  # connection_lost removes it from the set
                if victim is self:
                    return
            self._arm()

        def data_received(self, data: bytes) -> None:
            self._silent = False
            if self.conn.their_state is h11.IDLE and self._started is None:
                self._started = time.monotonic()  # a new request on a kept-alive connection: its own clock
            super().data_received(data)
            if self._receiving():
                self._arm()
            else:  # the whole request is in: its clock stops
                self._started = None
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None

        def connection_lost(self, exc) -> None:
            if getattr(self, "_timer", None) is not None:
                self._timer.cancel()
            super().connection_lost(exc)

        def _receiving(self) -> bool:
            return self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing()

        def _arm(self) -> None:
            if self._timer is None and self._started is not None and self._receiving():
                wait = max(0.0, self._started + request_timeout - time.monotonic())
                self._timer = self.loop.call_later(wait, self._expire)

        def _expire(self) -> None:
            self._timer = None
            if self._started is None or not self._receiving():
                self._started = None  # no request under way (idle between requests: uvicorn's keep-alive)
                return
            if time.monotonic() - self._started >= request_timeout:
                self.transport.close()
            else:
                self._arm()

    return GuardedH11Protocol


def server_config(app, *, log_level: str = "info", request_timeout: float = REQUEST_TIMEOUT_S,
                  max_connections: int = MAX_CONNECTIONS, **kw):
    """uvicorn's Config with the guarded protocol, and this process's file-descriptor limit raised to
    what the system allows (each connection holds one)."""
    import uvicorn  # the [serve] extra, as above

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = max(soft, 65536) if hard == resource.RLIM_INFINITY else hard
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # the soft limit stays; the connection cap still holds
    return uvicorn.Config(app, http=guarded_protocol(float(request_timeout), int(max_connections)),
                          lifespan="off", log_level=log_level, **kw,
                          # uvicorn answers 503 once its connections reach this. Ours are held at the cap,
                          # but a silent one that gives way is closed asynchronously: the margin covers those
                          limit_concurrency=2 * int(max_connections) + 1)


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (the command binds it before loading the model: a wrong --port or
    one in use is reported at once, not after the load)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: expected 0 to 65535")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
