"""Engine settings: one dataclass the API, the CLI and the workers share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_runtime.security.control_key import ControlKey
from moe_runtime.errors import InvalidRequestError
from moe_runtime.config.logprobs_mode import LOGPROBS_MODES
from moe_runtime.config.speculative import SpeculativeConfig
from moe_runtime.security.transfer_key import TransferKey


class EngineConfigError(InvalidRequestError):
    """A setting (or a combination of settings) the engine cannot run with; the message names the flag."""


if TYPE_CHECKING:
    import torch

# --dtype names -> torch dtype names (torch is imported where a dtype is needed: `moe-serve --help` stays quick)
DISAGGREGATION_MODES = ("none", "prefill", "decode")
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}
# --quantization choices (None, unset: as the checkpoint ships; "none": every weight in the compute dtype)
QUANTIZATIONS = (None, "none", "fp8", "int8", "mxfp4", "int4")
MODEL_IMPLS = ("auto", "native", "transformers")   # --model-impl
HOST_EXPERT_QUANTIZATIONS = (None, "none", "int8", "fp8")   # what --cpu-experts' host kernels run (kernels/cpu_native)


@dataclass
class EngineConfig:
    model: str
    device: str = "auto"                 # "cpu" | "cuda" | "auto"
    dtype: str = "auto"                  # "auto" = the checkpoint's torch_dtype (fp32 if unset)
    block_size: int = 16
    kv_cache_memory: int = 256 * 2**20   # bytes of KV cache per DP worker
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096   # tokens one step computes (prefill tokens of a step, chunked or not)
    enable_chunked_prefill: bool = True   # decodes and prefill chunks share each step, under that token budget
    enable_prefix_caching: bool = True    # full KV blocks are reused by requests sharing a prefix
    # KV tiers below the device pool (moe_runtime/kv_tiers): blocks the pool evicts are kept in host memory and/or
    # on disk, and a prefix found there is loaded back instead of computed again. Sizes are per rank (each keeps its
    # own layers and heads), like kv_cache_memory.
    kv_host_memory: int = 0               # bytes of host memory for evicted KV (0: no host tier)
    kv_disk_dir: str | None = None        # directory of the disk tier (None: none); kept across restarts
    kv_disk_size: int = 0                 # bytes the disk tier may hold (needed with kv_disk_dir)
    cache_aware_routing: bool = True      # with prefix caching and dp_attn > 1: route to where a prefix is cached
    max_model_len: int | None = None     # default: the model's max_position_embeddings
    kernels: str = "auto"                # "auto" | "torch" | "triton" | "cpu" (compiled CPU experts) | "reference"
    # which model code serves the checkpoint: "native" (our own port), "transformers" (transformers' modeling code
    # with our attention and MoE seam: moe_runtime/models/transformers_backend), "auto" (native where there is one)
    model_impl: str = "auto"
    quantization: str | None = None      # "fp8": projections and experts stay FP8 in memory (an FP8 checkpoint's
                                         # blocks as stored; others quantized at load); "int8": int8 with one
                                         # scale per output row, quantized at load; "int4": routed experts as
                                         # packed int4 with group scales (an int4 checkpoint's as stored, others
                                         # quantized at load); "none": every weight in dtype, an int4 or FP8
                                         # checkpoint's dequantized at load; None (unset): as the checkpoint
                                         # ships: in dtype, but an int4 checkpoint's routed experts stay int4
                                         # as stored (config/quantization_choice.py)
    # Parallel layout: world = ep ranks; dp_attn DP attention workers of ep // dp_attn ranks each.
    ep: int = 1
    dp_attn: int = 1
    tp: int = 1                          # tensor parallelism of dense models (heads, MLP, vocab)
    pp: int = 1                          # pipeline stages (layers split across ranks)
    pp_layers: tuple[int, ...] | None = None  # layers per stage; default: as even as possible
    pp_micro_batches: int = 0            # micro-batches per step so stages overlap (0 = pp)
    cp: int = 1                          # context parallelism: a DP worker's ranks split each step's tokens
                                         # (ep / dp_attn = attention TP x cp; without EP, tp x cp ranks)
    a2a_backend: str = "auto"            # "auto" | "local" | "all_to_all" | "allgather" | "deepep"
    dispatch_fp8: bool = False           # dispatch sends FP8 activations + per-128-column scales (GPU bandwidth)
    deepep_module: str = "deep_ep"       # the module whose `Buffer` is DeepEP's: deep_ep, or a drop-in (a fork)
    enable_two_batch_overlap: bool = False  # each step runs as two micro-batches, one's dispatch/combine in flight
                                         # while the other computes (SGLang's TBO, vLLM's DBO); see docs/design.md
    enable_torch_compile: bool = False   # pure decode steps run as one torch.compile graph per batch bucket
                                         # (moe_runtime/execution/decode_capture.py; SGLang's --enable-torch-compile)
    torch_compile_max_bs: int = 32       # the largest decode batch bucket captured; larger steps run eagerly
    torch_compile_backend: str = "inductor"  # torch.compile backend; "eager"/"aot_eager" trace only (debugging)
    torch_compile_wrapper: str = "aot"   # CPU: what runs inductor's graph: "python", "cpp" (its C++ wrapper) or
                                         # "aot" (AOTInductor, a library per bucket cached on disk)
    debug_host_reads: bool = False       # count each decode step's host reads (device values read on the host,
                                         # which stall a GPU and break graph capture): WorkerStats.decode_host_reads
    num_redundant_experts: int = 0       # extra physical expert slots for replicas of hot experts
    cpu_experts: bool = False            # routed experts in host memory, run by the CPU kernels on their own thread
                                         # while the shared experts run (KTransformers' split; moe/host_experts.py)
    device_resident_experts: int = 0     # with cpu_experts: each layer's N hottest routed experts (by recorded
                                         # load) keep a copy on the device and run there
    eplb_interval: int = 0               # rebalance experts every N steps (0 = only on demand)
    eplb_threshold: float = 0.0          # ... or when mean balancedness drops below this (0 = off)
    eplb_window: int = 128               # steps of expert load the rebalancer plans from
    eplb_layers_per_step: int = 0        # MoE layers whose weights move per step (0 = all at once)
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
    # Speculative decoding (vLLM's speculative_config): {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b}, {"method": "mtp", "num_speculative_tokens": k} (the
    # checkpoint's multi-token-prediction layer) or {"method": "eagle3", "model": DIR, "num_speculative_tokens": k}
    # (an EAGLE-3 draft head); None: off (moe_runtime/config/speculative.py)
    speculative_config: dict | None = None
    # Structured output: a grammar compiles off the stepping loop; one still compiling after this fails its request.
    grammar_compile_timeout_s: float = 10.0
    structured_output_any_whitespace: bool = False   # JSON output may hold whitespace between elements (else
                                                     # compact; a request's disable_any_whitespace decides for it)
    # What a sampled token's logprobs are (vLLM's --logprobs-mode): "raw_logprobs" (the model's), "processed_logprobs"
    # (of the distribution it was drawn from: an RL trainer's old-policy logprob), "raw_logits", "processed_logits"
    logprobs_mode: str = "raw_logprobs"
    # Batch-invariant output (moe_runtime/config/deterministic.py): a request's tokens and logprobs bitwise the same
    # whatever else is batched with it, however its prompt is chunked, on whichever DP worker
    deterministic: bool = False

    def validate(self) -> None:
        """Refuse a configuration that cannot run before anything is loaded or started.

        Messages name the `moe-serve` flag (`--dp-attn`); the `LLM` keyword is the same name with
        underscores. Checks that need the checkpoint (layouts the model admits) come later, in
        `ParallelLayout.validate`.
        """
        self.validate_options()
        self.validate_kv_tiers()
        if self.control_heartbeat_timeout_s is not None and not self.control_heartbeat_timeout_s > 0:
            raise EngineConfigError(f"--control-heartbeat-timeout {self.control_heartbeat_timeout_s}: must be > 0")
        if self.node_rank >= self.nnodes:
            raise EngineConfigError(f"--node-rank {self.node_rank} must be < --nnodes {self.nnodes}")
        if self.ep % self.dp_attn:
            raise EngineConfigError(f"--dp-attn {self.dp_attn} must divide --ep {self.ep} (each DP attention worker "
                                    f"spans ep / dp_attn ranks)")
        if self.nnodes > 1 and self.master_port is None:
            raise EngineConfigError(f"--nnodes {self.nnodes} needs --master-port "
                                    "(every node must meet at the same one)")
        if self.ep == 1 and self.num_redundant_experts:
            raise EngineConfigError(f"--num-redundant-experts {self.num_redundant_experts} needs --ep > 1 "
                                    "(redundant copies spread load over ranks; one rank has nothing to spread)")
        if self.ep == 1 and self.eplb_interval:
            raise EngineConfigError(f"--eplb-interval {self.eplb_interval} needs --ep > 1 "
                                    "(one rank has nothing to rebalance)")
        if self.ep == 1 and self.a2a_backend not in ("auto", "local"):
            raise EngineConfigError(f"--a2a-backend {self.a2a_backend} needs --ep > 1; with one rank it is 'local'")
        import torch

        if self.device == "cuda" and not torch.cuda.is_available():
            raise EngineConfigError("--device cuda: no CUDA device is visible to this process "
                                    "(use --device cpu, or auto)")
        if self.ranks_start_elsewhere:
            ControlKey.shared(self.control_key_file)  # refuse now, without a shared key, rather than after loading
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise EngineConfigError(f"--disaggregation-mode {self.disaggregation_mode!r}: choose one of "
                                    f"{', '.join(DISAGGREGATION_MODES)}")
        if self.disaggregation_mode != "none":
            if not self.kv_transfer_timeout_s > 0:
                raise EngineConfigError(f"--kv-transfer-timeout {self.kv_transfer_timeout_s}: must be > 0")
            TransferKey.shared(self.kv_transfer_key_file)  # the same: no instance of a P/D set runs without it

    def validate_kv_tiers(self) -> None:
        if self.kv_host_memory < 0 or self.kv_disk_size < 0:
            raise EngineConfigError("--kv-host-memory and --kv-disk-size must be >= 0")
        if self.kv_disk_dir is not None and self.kv_disk_size <= 0:
            raise EngineConfigError(f"--kv-disk-dir {self.kv_disk_dir}: give the tier's bound with --kv-disk-size "
                                    "(e.g. 500GiB)")
        if self.kv_disk_size and self.kv_disk_dir is None:
            raise EngineConfigError("--kv-disk-size needs --kv-disk-dir (where the tier's files go)")
        if (self.kv_host_memory or self.kv_disk_dir is not None) and not self.enable_prefix_caching:
            raise EngineConfigError("--kv-host-memory / --kv-disk-dir keep prefix-cache blocks below the device "
                                    "pool: they need --enable-prefix-caching")

    def validate_options(self) -> None:
        """The checks of options the parallel layout's own validation (`ParallelLayout.validate`, which
        names the `LLM` keywords and the values that would work) does not cover; `LLM` runs these too."""
        if not self.grammar_compile_timeout_s > 0:
            raise EngineConfigError(f"--grammar-compile-timeout {self.grammar_compile_timeout_s}: must be > 0")
        if self.quantization not in QUANTIZATIONS:
            raise EngineConfigError(f"--quantization {self.quantization} is not supported; choose one of "
                                    f"{[q for q in QUANTIZATIONS if q]} (or leave it unset: as the checkpoint ships)")
        SpeculativeConfig.parse(self.speculative_config)   # refuses unknown keys and methods not built, by name
        if self.model_impl not in MODEL_IMPLS:
            raise EngineConfigError(f"--model-impl {self.model_impl!r}: choose one of {', '.join(MODEL_IMPLS)}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise EngineConfigError(f"--logprobs-mode {self.logprobs_mode!r}: choose one of {', '.join(LOGPROBS_MODES)}")
        if self.ep == 1 and self.dispatch_fp8:
            raise EngineConfigError("--dispatch-fp8 needs --ep > 1 (one rank dispatches nothing over a wire)")
        if self.enable_torch_compile:
            self.validate_torch_compile()
        self.validate_cpu_experts()
        if self.deterministic:
            from moe_runtime.config.deterministic import validate_deterministic   # imports torch: only when asked

            validate_deterministic(self)
        if self.cp > 1 and self.enable_two_batch_overlap:
            raise EngineConfigError(f"--cp {self.cp} with --enable-two-batch-overlap: a context-parallel step "
                                    "exchanges every layer's new K/V over the whole step, which two micro-batches "
                                    "would have to pair up; use one of them")

    def validate_cpu_experts(self) -> None:
        """Host-held routed experts run eagerly through the contiguous-layout kernels, in float, int8 or FP8 weights."""
        if self.device_resident_experts < 0:
            raise EngineConfigError(f"--device-resident-experts {self.device_resident_experts}: must be >= 0")
        if self.device_resident_experts and not self.cpu_experts:
            raise EngineConfigError(f"--device-resident-experts {self.device_resident_experts} needs --cpu-experts "
                                    "(without it every routed expert is on the device already)")
        if not self.cpu_experts:
            return
        if self.enable_torch_compile:
            raise EngineConfigError("--cpu-experts with --enable-torch-compile: the host experts run on their own "
                                    "thread from host counts, which a captured step cannot hold; use one of them")
        if self.quantization not in HOST_EXPERT_QUANTIZATIONS:
            raise EngineConfigError(f"--cpu-experts with --quantization {self.quantization}: the host expert "
                                    "kernels run float32, bfloat16, int8 and FP8 experts; use --quantization fp8, "
                                    "int8 or none")
        if self.a2a_backend == "deepep":
            raise EngineConfigError("--cpu-experts with --a2a-backend deepep: DeepEP hands the experts device "
                                    "buffers (masked at decode) that the host kernel does not take; use "
                                    "all_to_all or allgather")

    def validate_torch_compile(self) -> None:
        """A captured decode step is one rank's whole forward with unquantized weights; the one exchange it may
        hold is DeepEP's low-latency dispatch and combine (fixed shapes, traced as operators), on ranks that are
        each their own DP attention worker."""
        if self.torch_compile_max_bs < 1:
            raise EngineConfigError(f"--torch-compile-max-bs {self.torch_compile_max_bs}: must be >= 1")
        if self.ep > 1 and (self.a2a_backend != "deepep" or self.dp_attn != self.ep):
            raise EngineConfigError(f"--enable-torch-compile with --ep {self.ep}: the captured decode step exchanges "
                                    "tokens through DeepEP's low-latency kernels only, on ranks that are each a DP "
                                    "attention worker: add --a2a-backend deepep --dp-attn "
                                    f"{self.ep} (or run without --enable-torch-compile)")
        spread = {"--tp": self.tp, "--pp": self.pp, "--cp": self.cp}
        blocking = [f"{flag} {value}" for flag, value in spread.items() if value > 1]
        if blocking:
            raise EngineConfigError(f"--enable-torch-compile with {', '.join(blocking)}: the captured decode step is "
                                    "one rank's forward; steps that exchange tokens or K/V between ranks are not "
                                    "captured yet (run without --enable-torch-compile)")
        if self.quantization not in (None, "none"):
            raise EngineConfigError(f"--enable-torch-compile with --quantization {self.quantization}: quantized "
                                    "weights run through their own grouped kernels, which the capture cannot fuse "
                                    "(as opaque calls inside the graph int8 decoded slower than without it, "
                                    "docs/design.md); use one of them")
        if self.enable_two_batch_overlap:
            raise EngineConfigError("--enable-torch-compile with --enable-two-batch-overlap: overlap needs several "
                                    "ranks, the capture one; use one of them")

    @property
    def decode_max_tokens(self) -> int:
        """The most tokens one DP worker's decode-phase step computes: what DeepEP's low-latency buffers are sized
        for and what bounds the captured step's largest bucket. One per sequence (`max_num_seqs`); with speculative
        decoding each sequence verifies up to `num_speculative_tokens` drafts beside its last token, and the
        scheduler gives drafts only what is left of the step's token budget (`max_num_batched_tokens`), so a
        step of drafts never passes the larger of that budget and `max_num_seqs`."""
        speculative = SpeculativeConfig.parse(self.speculative_config)
        if speculative is None:
            return self.max_num_seqs
        return min(self.max_num_seqs * (1 + speculative.num_speculative_tokens),
                   max(self.max_num_batched_tokens, self.max_num_seqs))

    def control_heartbeat_timeout_ms(self, from_env) -> int:
        """The control plane's heartbeat timeout in ms: the setting, else `from_env()` (the environment or 20 s)."""
        if self.control_heartbeat_timeout_s is not None:
            return max(1, round(self.control_heartbeat_timeout_s * 1000))
        return from_env()

    @property
    def ranks_start_elsewhere(self) -> bool:
        """Ranks on other nodes or from torchrun: they prove the shared control key to join."""
        return self.nnodes > 1 or not self.launch_workers

    def layout(self):
        from moe_runtime.config.parallel_layout import ParallelLayout

        return ParallelLayout(self.ep, self.dp_attn, self.num_redundant_experts, self.tp, self.pp,
                              tuple(self.pp_layers) if self.pp_layers else None, self.cp)

    @property
    def world_size(self) -> int:
        return self.layout().world_size

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            return torch.device(self.device)
        except RuntimeError as exc:
            raise InvalidRequestError(f"device={self.device!r} is not a torch device: {exc}") from exc

    def resolved_dtype(self, hf_config) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            found = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
            if isinstance(found, torch.dtype):
                return found
            return getattr(torch, DTYPES.get(str(found), "float32"))
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype={self.dtype!r} is not supported; choose one of {sorted(DTYPES)} or 'auto'")
        return getattr(torch, DTYPES[self.dtype])
