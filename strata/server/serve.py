"""Run the app under uvicorn on a socket bound here, so that `--port 0` can report its port."""

from __future__ import annotations

import ipaddress
import logging
import socket

import uvicorn

from strata.errors import StrataError
from strata.logs import StderrHandler
from strata.server.app import create_app
from strata.server.config import ServeConfig
from strata.server.faults import FaultPlan

log = logging.getLogger("strata.serve")


def _setup_logging() -> None:
    handler = StderrHandler("strata serve: %(message)s")
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("uvicorn").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StrataError(f"--host {host} --port {port}: cannot listen there "
                          f"({e.strerror or e})") from None
    sock.listen(128)
    return sock


HEAD_TIMEOUT_S = 10.0  # a connection must send a whole request head within this (slowloris)


def head_timeout_protocol(seconds: float = HEAD_TIMEOUT_S) -> type:
    """uvicorn's HTTP protocol, closing a connection that has no request running and has not
    sent a complete request head `seconds` after it opened or its last data arrived. (uvicorn's
    keep-alive timeout starts only after a response, so a connection that never sends a request,
    or sends half of one, would stay open for good.)"""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    base = import_from_string(HTTP_PROTOCOLS["auto"])

    class HeadTimeout(base):  # type: ignore[misc, valid-type]
        _head_timer = None

        def connection_made(self, transport) -> None:  # noqa: ANN001
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._idle():
                self._arm()
            elif self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def connection_lost(self, exc) -> None:  # noqa: ANN001
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _idle(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is None or getattr(cycle, "response_complete", False)

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(seconds, self._expire)

        def _expire(self) -> None:
            self._head_timer = None
            if self._idle() and not self.transport.is_closing():
                self.transport.close()

    return HeadTimeout


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(cfg: ServeConfig, fault: FaultPlan | None) -> int:
    _setup_logging()
    sock = bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    app = create_app(cfg, fault)
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=5, timeout_keep_alive=5,
                            http=head_timeout_protocol(cfg.head_timeout))
    server = uvicorn.Server(config)
    shown = f"[{host}]" if ":" in host else host
    log.info("listening on http://%s:%d/v1 (model %r; the engine loads in the background, "
             "GET /health shows its progress)", shown, port, cfg.served_name)
    log.info("chat page: http://%s:%d/", shown, port)
    if not _is_loopback(cfg.host) and cfg.api_key is None:
        log.warning("--host %s opens the server to the network without --api-key", cfg.host)
    if fault is not None:
        log.warning("STRATA_FAULT=%s: fault injection is on (for tests)", fault)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
