"""The warning for a server reachable from other machines with no API key."""
from __future__ import annotations

import ipaddress
import logging

from moe_runtime.server.server_config import ServerConfig

logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:   # a host name: it may resolve to anything
        return False


def warn_if_exposed(config: ServerConfig) -> None:
    """Listening beyond this machine without a key lets anyone who can connect use everything."""
    if not config.api_keys and not is_loopback(config.host):
        logger.warning("--host %s accepts connections from other machines and no --api-key is set: anyone who "
                       "can connect can generate, read the expert load and rebalance the experts. Set --api-key "
                       "(or listen on 127.0.0.1).", config.host)
