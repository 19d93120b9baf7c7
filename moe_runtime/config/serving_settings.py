"""The serving part of the engine's settings: how the job's processes start and meet (nodes, rendezvous, control
plane, restarts), its role in prefill/decode disaggregation, and the structured-output limits of its requests."""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.config.config_error import EngineConfigError

DISAGGREGATION_MODES = ("none", "prefill", "decode")


@dataclass
class ServingSettings:
    # Multi-process start-up: rendezvous for torch.distributed (env://), chosen free when None.
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    control_port: int | None = None      # the front's control port (multi-node default: master_port + 1)
    launch_workers: bool = True          # False: every rank is started elsewhere (torchrun) and connects
    control_key_file: str | None = None  # shared control secret of multi-node / external-worker jobs
                                         # (default: $MOE_RUNTIME_CONTROL_KEY); one node: a fresh one per launch
    worker_timeout_s: float = 600.0      # a collective stuck this long is a dead job
    control_heartbeat_timeout_s: float | None = None   # a silent control-plane peer (a node, a rank) is lost after
                                         # this (None: $MOE_RUNTIME_CONTROL_HEARTBEAT_TIMEOUT, else 20 s)
    max_rank_restarts: int = 3           # a lost rank: restart the job's ranks and resume its requests, at most this
                                         # often in 10 minutes (0: a lost rank ends the engine, for a supervisor)
    # Prefill/decode disaggregation (docs/design.md): this instance's role, and how KV blocks move between instances.
    disaggregation_mode: str = "none"    # "none" | "prefill" (parks KV for decode instances) | "decode" (pulls it)
    kv_transfer_host: str = "127.0.0.1"  # address this instance's KV sockets bind, and other instances reach
    kv_transfer_key_file: str | None = None  # the deployment's shared KV secret (default: $MOE_RUNTIME_KV_KEY)
    kv_transfer_timeout_s: float = 30.0  # parked KV not pulled, or a pull not done, by then is freed
    # Structured output: a grammar compiles off the stepping loop; one still compiling after this fails its request.
    grammar_compile_timeout_s: float = 10.0
    structured_output_any_whitespace: bool = False   # JSON output may hold whitespace between elements (else
                                                     # compact; a request's disable_any_whitespace decides for it)

    def validate(self) -> None:
        """The values alone; the shared keys the settings point at are read by `EngineConfig.validate`."""
        if not self.grammar_compile_timeout_s > 0:
            raise EngineConfigError(f"--grammar-compile-timeout {self.grammar_compile_timeout_s}: must be > 0")
        if self.control_heartbeat_timeout_s is not None and not self.control_heartbeat_timeout_s > 0:
            raise EngineConfigError(f"--control-heartbeat-timeout {self.control_heartbeat_timeout_s}: must be > 0")
        if self.node_rank >= self.nnodes:
            raise EngineConfigError(f"--node-rank {self.node_rank} must be < --nnodes {self.nnodes}")
        if self.nnodes > 1 and self.master_port is None:
            raise EngineConfigError(f"--nnodes {self.nnodes} needs --master-port "
                                    "(every node must meet at the same one)")
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise EngineConfigError(f"--disaggregation-mode {self.disaggregation_mode!r}: choose one of "
                                    f"{', '.join(DISAGGREGATION_MODES)}")
        if self.disaggregation_mode != "none" and not self.kv_transfer_timeout_s > 0:
            raise EngineConfigError(f"--kv-transfer-timeout {self.kv_transfer_timeout_s}: must be > 0")

    @property
    def ranks_start_elsewhere(self) -> bool:
        """Ranks on other nodes or from torchrun: they prove the shared control key to join."""
        return self.nnodes > 1 or not self.launch_workers

    def control_heartbeat_timeout_ms(self, from_env) -> int:
        """The control plane's heartbeat timeout in ms: the setting, else `from_env()` (the environment or 20 s)."""
        if self.control_heartbeat_timeout_s is not None:
            return max(1, round(self.control_heartbeat_timeout_s * 1000))
        return from_env()
