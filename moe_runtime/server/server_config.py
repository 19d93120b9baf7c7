"""What `moe-serve` needs besides the engine's `EngineConfig`: the HTTP side and which model to serve."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moe_runtime.demo.demo_model import ensure_demo_model
from moe_runtime.errors import MoERuntimeError

DEMO_SERVED_NAME = "moe-runtime-demo"


class ServerConfigError(MoERuntimeError):
    """A flag value `moe-serve` cannot run with (outside the engine's settings); the message names the flag."""



DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20   # the HTTP request-size limit unless --max-request-bytes says otherwise
DEFAULT_RESPONSE_STORE_BYTES = 256 * 2**20   # the Responses API's stored answers (`server.responses.store`)
DEFAULT_RESPONSE_TTL_S = 3600                # ... each kept an hour

@dataclass
class ResolvedModel:
    path: str           # the checkpoint directory the engine loads
    served_name: str    # the model name clients use


@dataclass
class ServerConfig:
    model: str | None = None              # checkpoint directory; None = the embedded demo model
    served_model_name: str | None = None  # default: the checkpoint directory's name
    host: str = "127.0.0.1"
    port: int = 8000                      # 0 = a free one
    api_keys: tuple[str, ...] = ()        # --api-key, repeatable: one per tenant (empty: no key)
    admin_key: str | None = None          # --admin-key: the routes acting on every tenant (server.admin_routes)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES   # larger request bodies get HTTP 413
    response_store_bytes: int = DEFAULT_RESPONSE_STORE_BYTES   # the Responses API's stored answers, all keys
    response_ttl_s: int = DEFAULT_RESPONSE_TTL_S               # ... each kept this long
    max_queue: int = 512                  # requests waiting for their first token; more get HTTP 429
    shutdown_timeout_s: int = 20          # SIGTERM: seconds the running requests may take to finish (0: none)
    log_level: str = "info"
    tool_call_parser: str | None = None   # None: from the chat template, then the model type
    reasoning_parser: str | None = None   # None: no reasoning split (gpt-oss: harmony in any case)
    pd: str | None = None                 # "P:D": start P prefill and D decode instances and a router (a P/D set)
    pd_prefill_args: str = ""             # ... extra flags of the prefill instances (e.g. "--ep 2 --dp-attn 1")
    pd_decode_args: str = ""              # ... and of the decode instances

    def validate(self) -> None:
        if len(set(self.api_keys)) != len(self.api_keys):
            raise ServerConfigError("--api-key: the same key is given twice")
        if self.admin_key is not None and (not self.admin_key or self.admin_key in self.api_keys):
            raise ServerConfigError("--admin-key: give a key of its own, not empty and none of the --api-key ones")
        if self.pd is not None and len(self.api_keys) > 1:
            raise ServerConfigError("--pd takes one --api-key (its router passes it on to the instances); "
                                    "serve several tenants' keys from instances started on their own")
        if self.model is not None and not Path(self.model).is_dir():
            raise ServerConfigError(f"--model {self.model}: no such checkpoint directory")
        if self.pd is not None:
            self.pd_counts()

    def pd_counts(self) -> tuple[int, int]:
        """(prefill instances, decode instances) of --pd P:D."""
        prefill, separator, decode = (self.pd or "").partition(":")
        if not (separator and prefill.isdigit() and decode.isdigit() and int(prefill) > 0 and int(decode) > 0):
            raise ServerConfigError(f"--pd {self.pd!r}: give prefill:decode instance counts, e.g. 1:1 or 1:2")
        return int(prefill), int(decode)

    def resolve_model(self) -> ResolvedModel:
        """The checkpoint to load and its served name; builds the demo model on first use (slow: call it
        where the HTTP server already answers)."""
        if self.model is None:
            return ResolvedModel(str(ensure_demo_model()), self.served_model_name or DEMO_SERVED_NAME)
        path = Path(self.model).expanduser().resolve()
        return ResolvedModel(str(path), self.served_model_name or path.name)
