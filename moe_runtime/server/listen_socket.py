"""The listening socket `moe-serve` binds before loading anything, so a taken port fails at once."""
from __future__ import annotations

import socket

from moe_runtime.server.server_config import ServerConfigError


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServerConfigError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def socket_url(sock: socket.socket) -> str:
    """http://host:port of a bound socket (the port it got when asked for 0; IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
