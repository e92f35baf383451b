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
                            timeout_graceful_shutdown=5, timeout_keep_alive=5)
    server = uvicorn.Server(config)
    shown = f"[{host}]" if ":" in host else host
    log.info("listening on http://%s:%d/v1 (model %r; the engine loads in the background, "
             "GET /health shows its progress)", shown, port, cfg.served_name)
    if not _is_loopback(cfg.host) and cfg.api_key is None:
        log.warning("--host %s opens the server to the network without --api-key", cfg.host)
    if fault is not None:
        log.warning("STRATA_FAULT=%s: fault injection is on (for tests)", fault)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
