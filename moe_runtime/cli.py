"""`moe-serve`: load a model and serve the OpenAI-compatible HTTP API.

    moe-serve                                   # the embedded demo model on 127.0.0.1:8000
    moe-serve --model /path/to/hf-checkpoint --port 8080 --api-key secret
    moe-serve --dp-attn 8 --ep 8 ...            # multi-process expert parallel (see build_engine)

`python -m moe_runtime.cli --help` lists every flag.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import re
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path

import uvicorn

from attention_dp.control_key import CONTROL_KEY_ENV, ControlKey
from moe_runtime.engine_config import DTYPES, EngineConfig
from moe_runtime.engine_factory import make_engine
from moe_runtime.engine_protocol import Engine
from moe_runtime.errors import MoERuntimeError

logger = logging.getLogger("moe_runtime.cli")

DEMO_SERVED_NAME = "moe-runtime-demo"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


class ServeConfigError(MoERuntimeError):
    """A flag value (or a combination of flags) the launcher cannot run with; the message names the flag."""


# ServeConfig fields handed to EngineConfig under the same name when the engine has them.
LAYOUT_FIELDS = ("ep", "dp_attn", "tp", "pp", "a2a_backend", "num_redundant_experts", "eplb_interval",
                 "master_addr", "master_port", "nnodes", "node_rank", "control_port", "launch_workers",
                 "control_key_file")


def parse_size(text: str) -> int:
    """Bytes from '512M', '2G', '1.5GiB', '268435456' (binary units: 1K = 1024)."""
    match = _SIZE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use bytes or a number with K/M/G/T, e.g. 512M, 2G")
    value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def _port(text: str) -> int:
    value = _non_negative(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0..65535)")
    return value


def a2a_backends() -> tuple[str, ...]:
    from dispatch.config import BACKENDS

    return BACKENDS


@dataclass
class ServeConfig:
    """Everything `moe-serve` was asked for; `engine_config()` is the part the engine takes."""

    model: str | None = None              # None = the embedded demo model
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_request_bytes: int = 4 * 2**20    # larger request bodies get HTTP 413
    max_queue: int = 512
    # engine
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    kv_cache_memory: int = 256 * 2**20
    block_size: int = 16
    kernels: str = "auto"
    # parallel layout (multi-process engine)
    dp_attn: int = 1
    ep: int = 1
    tp: int = 1
    pp: int = 1
    a2a_backend: str = "auto"
    num_redundant_experts: int = 0
    eplb_interval: int = 0
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None        # None = a free port (single node)
    control_port: int | None = None       # the front's control port; multi-node default: master_port + 1
    launch_workers: bool = True           # False: ranks come from elsewhere (torchrun) and connect
    control_key_file: str | None = None   # shared control secret of ranks started elsewhere ($MOE_RUNTIME_CONTROL_KEY)
    log_level: str = "info"

    def validate(self) -> None:
        if self.node_rank >= self.nnodes:
            raise ServeConfigError(f"--node-rank {self.node_rank} must be < --nnodes {self.nnodes}")
        if self.ep % self.dp_attn:
            raise ServeConfigError(f"--dp-attn {self.dp_attn} must divide --ep {self.ep} (each DP attention worker "
                                   f"spans ep / dp_attn ranks)")
        if self.nnodes > 1 and self.master_port is None:
            raise ServeConfigError(f"--nnodes {self.nnodes} needs --master-port (every node must meet at the same one)")
        if self.ep == 1 and self.num_redundant_experts:
            raise ServeConfigError(f"--num-redundant-experts {self.num_redundant_experts} needs --ep > 1 "
                                   "(redundant copies spread load over ranks; one rank has nothing to spread)")
        if self.ep == 1 and self.eplb_interval:
            raise ServeConfigError(f"--eplb-interval {self.eplb_interval} needs --ep > 1 (one rank has nothing to rebalance)")
        if self.ep == 1 and self.a2a_backend not in ("auto", "local"):
            raise ServeConfigError(f"--a2a-backend {self.a2a_backend} needs --ep > 1; with one rank it is 'local'")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ServeConfigError("--device cuda: no CUDA device is visible to this process "
                                       "(use --device cpu, or auto)")
        if self.ranks_start_elsewhere:
            ControlKey.shared(self.control_key_file)  # refuse now, before loading anything, without one
        if self.model is not None and not Path(self.model).is_dir():
            raise ServeConfigError(f"--model {self.model}: no such checkpoint directory")

    @property
    def ranks_start_elsewhere(self) -> bool:
        """Ranks on other nodes or from torchrun: they prove the shared control key to join."""
        return self.nnodes > 1 or not self.launch_workers

    def engine_config(self, model_path: str) -> EngineConfig:
        """The EngineConfig for these flags. Layout flags the engine has no field for yet are refused by name
        (left at their defaults they are simply not passed)."""
        kwargs = dict(
            model=model_path, device=self.device, dtype=self.dtype, block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            kernels=self.kernels,
        )
        known = {f.name for f in fields(EngineConfig)}
        defaults = ServeConfig(model=None)
        missing = []
        for name in LAYOUT_FIELDS:
            value = getattr(self, name)
            if name in known:
                kwargs[name] = value
            elif value != getattr(defaults, name):
                missing.append(f"--{name.replace('_', '-')} {value}")
        if missing:
            raise ServeConfigError(f"{', '.join(missing)}: not available yet in this engine")
        return EngineConfig(**kwargs)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServeConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-serve",
        description="Serve a Mixture-of-Experts model over an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /v1/expert_load).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = ServeConfig()
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="HF checkpoint directory (config.json, safetensors, tokenizer); "
                        "default: the embedded demo model, built into the cache on first use")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients use; default: the checkpoint directory's name "
                        f"('{DEMO_SERVED_NAME}' for the demo)")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", *sorted(DTYPES)],
                   help="weight/activation dtype; auto = the checkpoint's")
    g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"], help="auto = cuda when available")
    g.add_argument("--kernels", default=d.kernels, choices=["auto", "torch", "triton", "reference"],
                   help="MoE/attention kernel implementation")

    g = p.add_argument_group("scheduling and memory")
    g.add_argument("--max-num-seqs", type=_positive, default=d.max_num_seqs, help="requests in one batch per DP worker")
    g.add_argument("--max-num-batched-tokens", type=_positive, default=d.max_num_batched_tokens,
                   help="prompt tokens in one prefill batch")
    g.add_argument("--max-model-len", type=_positive, default=None,
                   help="context length (prompt + output); default: the model's max_position_embeddings")
    g.add_argument("--kv-cache-memory", type=parse_size, default=d.kv_cache_memory,
                   help="KV cache per DP worker: bytes or a size such as 512M, 2G")
    g.add_argument("--block-size", type=_positive, default=d.block_size, help="tokens per KV cache block")
    g.add_argument("--max-queue", type=_positive, default=d.max_queue,
                   help="requests that may wait for their first token; more get HTTP 429 with Retry-After")

    g = p.add_argument_group("parallelism (more than 1 starts one worker process per rank)")
    g.add_argument("--dp-attn", type=_positive, default=d.dp_attn, help="data-parallel attention workers")
    g.add_argument("--ep", type=_positive, default=d.ep, help="expert-parallel ranks")
    g.add_argument("--tp", type=_positive, default=d.tp, help="tensor-parallel size")
    g.add_argument("--pp", type=_positive, default=d.pp, help="pipeline-parallel stages")
    g.add_argument("--a2a-backend", default=d.a2a_backend, choices=a2a_backends(),
                   help="token dispatch/combine backend between expert-parallel ranks")
    g.add_argument("--num-redundant-experts", type=_non_negative, default=d.num_redundant_experts,
                   help="extra expert slots per MoE layer for replicas of hot experts")
    g.add_argument("--eplb-interval", type=_non_negative, default=d.eplb_interval,
                   help="engine steps between expert rebalances; 0 = never")
    g.add_argument("--nnodes", type=_positive, default=d.nnodes, help="nodes in the job")
    g.add_argument("--node-rank", type=_non_negative, default=d.node_rank, help="this node's rank")
    g.add_argument("--master-addr", default=d.master_addr, help="rendezvous address (torch.distributed env://)")
    g.add_argument("--master-port", type=_port, default=d.master_port,
                   help="rendezvous port; default: a free one (single node only)")
    g.add_argument("--control-port", type=_port, default=d.control_port,
                   help="port where the front (node 0) takes its ranks' connections; default: master port + 1")
    g.add_argument("--external-workers", dest="launch_workers", action="store_false",
                   help="start no worker here: every rank is started elsewhere, e.g. by torchrun running "
                        "'python -m moe_runtime.worker --control-addr A --control-port C'")
    g.add_argument("--control-key-file", default=None,
                   help="file holding the secret that ranks of a multi-node or --external-workers job share "
                        f"(default: ${CONTROL_KEY_ENV}; one node: a fresh secret per launch)")

    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default=d.host, help="address to listen on (0.0.0.0 for every interface)")
    g.add_argument("--port", type=_port, default=d.port, help="port to listen on; 0 picks a free one")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on every route but /health and /metrics "
                        "(a browser opening /dashboard or /docs asks for it as the password)")
    g.add_argument("--max-request-bytes", type=parse_size, default=d.max_request_bytes,
                   help="largest request body accepted, e.g. 4M; larger ones get HTTP 413")
    g.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    return p


def resolve_model(config: ServeConfig) -> tuple[str, str]:
    """(checkpoint path, served model name); builds the demo model on first use."""
    if config.model is None:
        from moe_runtime.demo import ensure_demo_model

        logger.info("no --model given: using the embedded demo model (built on first use)")
        path = str(ensure_demo_model())
        return path, config.served_model_name or DEMO_SERVED_NAME
    path = str(Path(config.model).expanduser().resolve())
    return path, config.served_model_name or Path(path).name


def build_engine(config: ServeConfig, model_path: str) -> Engine:
    """The engine `moe-serve` runs: in-process for one rank, the multi-process engine otherwise (as `LLM` picks)."""
    engine_config = config.engine_config(model_path)
    if engine_config.world_size > 1 or config.ranks_start_elsewhere:
        logger.info("starting %d worker ranks (ep %d, dp-attn %d, tp %d, pp %d)", engine_config.world_size,
                    config.ep, config.dp_attn, config.tp, config.pp)
    return make_engine(engine_config)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServeConfigError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


DEAD_ENGINE_GRACE_S = 2.0


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:   # a host name: it may resolve to anything
        return False


def warn_if_exposed(config: ServeConfig) -> None:
    """Listening beyond this machine without a key lets anyone who can connect use everything."""
    if config.api_key is None and not is_loopback(config.host):
        logger.warning("--host %s accepts connections from other machines and no --api-key is set: anyone who "
                       "can connect can generate, read the expert load and rebalance the experts. Set --api-key "
                       "(or listen on 127.0.0.1).", config.host)


@dataclass
class EngineLaunch:
    """The engine `serve` builds in a background thread while the HTTP server already answers 503."""

    config: ServeConfig
    served_name: str = ""
    async_engine: object | None = None   # an AsyncEngine, once started
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        from moe_runtime.async_engine import AsyncEngine, AsyncEngineConfig

        try:
            model_path, self.served_name = resolve_model(self.config)
            logger.info("loading %s from %s", self.served_name, model_path)
            engine = build_engine(self.config, model_path)
            self.async_engine = AsyncEngine(engine, AsyncEngineConfig(max_queue=self.config.max_queue)).start()
        except BaseException as exc:  # noqa: BLE001 - re-raised by serve() once the HTTP server has stopped
            self.error = exc
        finally:
            self.done.set()

    def begin_shutdown(self) -> None:
        if self.async_engine is not None:
            self.async_engine.begin_shutdown()

    def shutdown(self) -> None:
        """Stop the engine; one still being built is waited for first (its ranks must not outlive us)."""
        self.done.wait()
        if self.async_engine is not None:
            self.async_engine.shutdown()


def serve(config: ServeConfig) -> int:
    """Listen at once (503 while starting), build the engine in a thread, then serve; the exit code.

    The start-up line `moe-serve: serving ...` is printed once the engine is ready; an engine that
    fails to start stops the server and its error is raised as before.
    """
    from server.app import build_app
    from server.dashboard import dashboard_router
    from server.startup_gate import StartupGate

    config.validate()
    warn_if_exposed(config)
    sock = bind_socket(config.host, config.port)  # fail on a taken port before loading anything
    host, port = sock.getsockname()[:2]
    url = f"http://{_url_host(host)}:{port}"
    gate = StartupGate()
    launch = EngineLaunch(config)
    server = _Server(uvicorn.Config(gate, log_level=config.log_level, access_log=config.log_level == "debug",
                                    timeout_graceful_shutdown=5, lifespan="off"),
                     on_exit=launch.begin_shutdown)
    exit_code = 0

    async def announce_listening() -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.02)
        if server.started:
            print(f"moe-serve: listening on {url}; starting the engine (/health answers 503 until it is ready)\n",
                  end="", flush=True)   # one write: log lines on stderr cannot land inside it

    async def start_then_serve() -> None:
        announcer = asyncio.create_task(announce_listening())
        await asyncio.to_thread(launch.run)
        await announcer
        if launch.error is not None:
            server.should_exit = True
            return
        gate.open(build_app(launch.async_engine, launch.served_name, api_key=config.api_key,
                            extra_routers=[dashboard_router(config.api_key)],
                            max_request_bytes=config.max_request_bytes))
        if server.should_exit:
            return
        print(f"moe-serve: serving {launch.served_name!r} on {url} (Ctrl-C to stop)\n", end="", flush=True)
        await stop_when_the_engine_dies()

    async def stop_when_the_engine_dies() -> None:
        """A dead rank makes the service useless: report it for a moment (/health 503, in-flight
        requests end with 5xx errors), then exit non-zero so a supervisor restarts the whole job."""
        nonlocal exit_code
        while not server.should_exit:
            health = launch.async_engine.health()
            if not health.healthy:
                logger.error("engine died (%s); exiting with code 1 in %.0fs", health.detail, DEAD_ENGINE_GRACE_S)
                await asyncio.sleep(DEAD_ENGINE_GRACE_S)
                exit_code = 1
                server.should_exit = True
                return
            await asyncio.sleep(0.25)

    async def run() -> None:
        starting = asyncio.create_task(start_then_serve())
        try:
            await server.serve(sockets=[sock])
        finally:
            starting.cancel()

    # uvicorn handles SIGINT/SIGTERM itself (graceful HTTP shutdown), then restores these handlers and
    # raises the signal again: the handler below turns that SIGTERM into an exception, so the engine
    # (and, multi-process, its workers) is always shut down below instead of the process just dying.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        asyncio.run(run())
    except _Terminated:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        launch.shutdown()
        sock.close()
        logger.info("stopped")
    if launch.error is not None:
        raise launch.error
    return exit_code


class _Terminated(Exception):
    """SIGTERM arrived (after uvicorn's graceful shutdown)."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


class _Server(uvicorn.Server):
    """uvicorn's server that also tells the engine to stop when a signal arrives (in-flight requests end)."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServeConfig.from_args(args)
    try:
        if config.node_rank > 0:
            config.validate()
            from moe_runtime.node_launcher import run_worker_node

            layout = config.engine_config("unused").layout()
            return run_worker_node(layout.world_size, config.nnodes, config.node_rank, config.master_addr,
                                   config.control_port or config.master_port + 1,
                                   ControlKey.shared(config.control_key_file))
        return serve(config)
    except MoERuntimeError as exc:
        parser.exit(2, f"moe-serve: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
