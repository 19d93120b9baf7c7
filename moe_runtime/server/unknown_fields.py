"""Request fields this server does not know: ignored, as vLLM's server ignores them, with one warning per name.

Clients written for other servers send fields this one has no use for (`vllm bench serve` sends
`repetition_penalty`, SDKs send `store`, `metadata`, `service_tier`, chat history replays carry
per-message extras). Refusing them would turn each such request into a 400; ignoring them silently
would hide a setting that has no effect. So each name is logged once per server, at warning level.

Nested fields are named by their path without list indices (`messages[].audio`), so that a field
carried by every message of every request is still one warning.
"""
from __future__ import annotations

import logging
import threading

from pydantic import BaseModel


def unknown_field_names(request: BaseModel, prefix: str = "") -> list[str]:
    """The names of the fields in `request` (and the models nested in it) that its schema does not define."""
    names = [prefix + name for name in (request.model_extra or {})]
    for field_name in type(request).model_fields:
        value = getattr(request, field_name)
        if isinstance(value, BaseModel):
            names += unknown_field_names(value, f"{prefix}{field_name}.")
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, BaseModel):
                    names += unknown_field_names(item, f"{prefix}{field_name}[].")
    return list(dict.fromkeys(names))


class UnknownFieldWarnings:
    """Warns once per unknown field name; one instance per server (per app), shared by its endpoints.

    Requests are converted in worker threads, hence the lock: two requests bringing the same new
    name at once still make one warning.
    """

    def __init__(self, logger: logging.Logger | None = None):
        self.logger = logger or logging.getLogger(__name__)
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def warn_new(self, request: BaseModel, endpoint: str) -> None:
        for name in unknown_field_names(request):
            with self._lock:
                if name in self._warned:
                    continue
                self._warned.add(name)
            self.logger.warning("%s: ignoring unknown request field %r (warned once per field name)",
                                endpoint, name)
