"""`moe-serve`: load a model and serve the OpenAI-compatible HTTP API.

    moe-serve                                   # the embedded demo model on 127.0.0.1:8000
    moe-serve --model /path/to/hf-checkpoint --port 8080 --api-key secret
    moe-serve --dp-attn 8 --ep 8 ...            # multi-process expert parallel
    moe-serve ... --nnodes 2 --node-rank 1 ...  # another node's ranks (moe_runtime.processes.node_launcher)

`python -m moe_runtime.server.cli --help` lists every flag. Each flag's destination is the name of a field of
exactly one of `ServerConfig` (HTTP, model choice) and `EngineConfig` (the engine), and its default
is that field's default; the parser's values become the two configs by name.

The arguments are parsed before the serving stack is imported (uvicorn, the engine and its worker
processes), and `moe-serve: starting` is printed before that import, so the wait is not silent.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import logging
import os
import sys

from moe_runtime.security.control_key import CONTROL_KEY_ENV
from moe_runtime.dispatch.backends import BACKENDS
from moe_runtime.config.engine_config import DISAGGREGATION_MODES, DTYPES, MODEL_IMPLS, QUANTIZATIONS, EngineConfig
from moe_runtime.config.logprobs_mode import LOGPROBS_MODES
from moe_runtime.security.transfer_key import KV_KEY_ENV
from moe_runtime.errors import MoERuntimeError
from moe_runtime.server.flag_help import DefaultsHelpFormatter
from moe_runtime.server.flag_types import AppendToTuple, json_object, non_negative_int, parse_size, positive_int, tcp_port
from moe_runtime.server.server_config import DEMO_SERVED_NAME, ServerConfig
from moe_runtime.server.reasoning.names import REASONING_PARSER_NAMES
from moe_runtime.server.tool_calls.names import TOOL_CALL_PARSER_NAMES

UNRESOLVED_MODEL = ""   # EngineConfig.model until `--model` (or the demo) is resolved, at launch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-serve",
        description="Serve a Mixture-of-Experts model over an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /v1/expert_load) "
                    "with a live expert-load dashboard at /dashboard. Stays in the foreground until Ctrl-C.",
        formatter_class=DefaultsHelpFormatter,
    )
    e = EngineConfig(model=UNRESOLVED_MODEL)   # the defaults of the engine flags
    s = ServerConfig()                          # ... and of the server's
    g = p.add_argument_group("model")
    g.add_argument("--model", default=s.model,
                   help="HF checkpoint directory (config.json, safetensors, tokenizer); "
                        "default: the embedded demo model, built into the cache on first use")
    g.add_argument("--served-model-name", default=s.served_model_name,
                   help="model name clients use; default: the checkpoint directory's name "
                        f"('{DEMO_SERVED_NAME}' for the demo)")
    g.add_argument("--dtype", default=e.dtype, choices=["auto", *sorted(DTYPES)],
                   help="weight/activation dtype; auto = the checkpoint's")
    g.add_argument("--device", default=e.device, choices=["auto", "cpu", "cuda"], help="auto = cuda when available")
    g.add_argument("--quantization", default=e.quantization, choices=[q for q in QUANTIZATIONS if q],
                   help="fp8: keep linear and expert weights in FP8 with block scales (an FP8 checkpoint as "
                        "stored, any other quantized at load), dequantized per matmul tile; int8: keep them int8 "
                        "with one scale per output row, quantized at load (weight-only: activations stay in "
                        "--dtype); mxfp4: keep the routed experts in MXFP4 (gpt-oss's as stored); int4: keep the "
                        "routed experts as packed int4 with group scales, an int4 checkpoint's (compressed-tensors, "
                        "AWQ, GPTQ) as stored, any other's rounded at load to groups of 128 (lossy); none: every weight "
                        "in --dtype, an int4 or FP8 checkpoint's dequantized at load; unset: as the checkpoint "
                        "ships: weights in --dtype (FP8 checkpoints are dequantized at load), but an int4 "
                        "checkpoint keeps its routed experts int4 as stored (int4 chosen by itself; an expert weight "
                        "it stores in float is refused by name)")
    g.add_argument("--kernels", default=e.kernels, choices=["auto", "torch", "triton", "cpu", "reference"],
                   help="MoE/attention kernel implementation (auto: triton on CUDA where it imports, else torch; "
                        "cpu: the torch family with the routed experts and the few-row projections in C++ kernels "
                        "compiled on first use for this CPU)")
    g.add_argument("--model-impl", default=e.model_impl, choices=list(MODEL_IMPLS),
                   help="native: our own port of the architecture; transformers: transformers' modeling code with "
                        "our paged attention and MoE executor plugged in (any *ForCausalLM it ships); auto: native "
                        "where there is a port, else transformers")
    g.add_argument("--cpu-experts", action=argparse.BooleanOptionalAction, default=e.cpu_experts,
                   help="keep the routed experts in host memory and run them with the CPU kernels on their own "
                        "thread while attention, the router and the shared experts run on the device")
    g.add_argument("--device-resident-experts", type=non_negative_int, default=e.device_resident_experts,
                   help="with --cpu-experts: each MoE layer's N hottest routed experts (by the recorded load, "
                        "re-chosen every --eplb-window steps) keep a copy on the device and run there")
    g.add_argument("--enable-torch-compile", action=argparse.BooleanOptionalAction, default=e.enable_torch_compile,
                   help="capture decode steps: each batch size bucket (1, 2, 4, ... --torch-compile-max-bs) compiles "
                        "once with torch.compile (the first step of a bucket waits for it, tens of seconds on CPU); "
                        "one rank, unquantized weights; without a C++ compiler decode runs eagerly")
    g.add_argument("--torch-compile-max-bs", type=positive_int, default=e.torch_compile_max_bs,
                   help="the largest decode batch captured with --enable-torch-compile; larger ones run eagerly")
    g.add_argument("--tool-call-parser", default=s.tool_call_parser, choices=sorted(TOOL_CALL_PARSER_NAMES),
                   help="how the model writes tool calls (read for tool_choice auto); default: recognised from "
                        "the chat template, else the model type")
    g.add_argument("--reasoning-parser", default=s.reasoning_parser, choices=sorted(REASONING_PARSER_NAMES),
                   help="split the model's thinking into chat answers' reasoning_content (and reasoning); "
                        "default: none, except gpt-oss, which always answers in harmony channels")

    g = p.add_argument_group("scheduling and memory")
    g.add_argument("--max-num-seqs", type=positive_int, default=e.max_num_seqs,
                   help="requests in one batch per DP worker")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=e.max_num_batched_tokens,
                   help="tokens one engine step computes per DP worker (with chunked prefill: decodes plus "
                        "prefill chunks; without: the prompts of one prefill batch)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=e.enable_chunked_prefill,
                   help="run prefill chunks in the same steps as decodes, under --max-num-batched-tokens "
                        "(a long prompt is split over several steps)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=e.enable_prefix_caching,
                   help="reuse the KV blocks of a prompt prefix another request computed (system prompts, "
                        "multi-turn chat); POST /reset_prefix_cache forgets them")
    g.add_argument("--max-model-len", type=positive_int, default=e.max_model_len,
                   help="context length (prompt + output); default: the model's max_position_embeddings")
    g.add_argument("--kv-cache-memory", type=parse_size, default=e.kv_cache_memory,
                   help="KV cache per DP worker: bytes or a size such as 512M, 2G")
    g.add_argument("--block-size", type=positive_int, default=e.block_size, help="tokens per KV cache block")
    g.add_argument("--kv-host-memory", type=parse_size, default=e.kv_host_memory,
                   help="host memory per rank for KV blocks the device pool evicts (e.g. 32GiB): a prefix found "
                        "there is loaded back instead of computed again (SGLang's HiCache, vLLM's KV offloading)")
    g.add_argument("--kv-disk-dir", default=e.kv_disk_dir,
                   help="a directory for a disk tier below host memory: evicted KV blocks are written there (0600, "
                        "hash-checked) and found again after a restart of moe-serve")
    g.add_argument("--kv-disk-size", type=parse_size, default=e.kv_disk_size,
                   help="bytes the disk tier may hold per rank (e.g. 500GiB; needed with --kv-disk-dir)")
    g.add_argument("--grammar-compile-timeout", dest="grammar_compile_timeout_s", type=float,
                   default=e.grammar_compile_timeout_s,
                   help="seconds a structured-output grammar may take to compile (off the stepping loop; the "
                        "request waits, the others do not); a request whose grammar takes longer fails alone")
    g.add_argument("--structured-output-any-whitespace", action=argparse.BooleanOptionalAction,
                   default=e.structured_output_any_whitespace,
                   help="let JSON structured output (json_schema, json_object, forced tool calls) hold whitespace "
                        "between elements (at most 16 characters in a row); by default it is compact, as with "
                        "vLLM's disable-any-whitespace. A request decides for itself with "
                        "structured_outputs.disable_any_whitespace")
    g.add_argument("--logprobs-mode", default=e.logprobs_mode, choices=LOGPROBS_MODES,
                   help="what a sampled token's logprobs are (vLLM's): raw_logprobs, the model's own; "
                        "processed_logprobs, those of the distribution the token was drawn from (after penalties, "
                        "logit_bias, grammars, temperature, min-p, top-k, top-p: an RL trainer's old-policy "
                        "logprobs); raw_logits and processed_logits, the same before the log-softmax")
    g.add_argument("--speculative-config", type=json_object, default=e.speculative_config,
                   help='speculative decoding, as JSON with vLLM\'s names: {"method": "ngram", '
                        '"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4} drafts by '
                        'prompt lookup, {"method": "mtp", "num_speculative_tokens": 2} with the checkpoint\'s '
                        'multi-token-prediction layer, {"method": "eagle3", "model": DIR, '
                        '"num_speculative_tokens": 3} with an EAGLE-3 draft head; the drafts are verified in one '
                        'forward (greedy output '
                        'exact, sampled output by speculative sampling)')
    g.add_argument("--max-queue", type=positive_int, default=s.max_queue,
                   help="requests that may wait for their first token; more get HTTP 429 with Retry-After")

    g = p.add_argument_group("parallelism (more than 1 starts one worker process per rank)")
    g.add_argument("--dp-attn", type=positive_int, default=e.dp_attn, help="data-parallel attention workers")
    g.add_argument("--ep", type=positive_int, default=e.ep, help="expert-parallel ranks")
    g.add_argument("--tp", type=positive_int, default=e.tp, help="tensor-parallel size")
    g.add_argument("--pp", type=positive_int, default=e.pp, help="pipeline-parallel stages")
    g.add_argument("--cp", type=positive_int, default=e.cp,
                   help="context parallelism: the ranks of a DP attention worker split each step's tokens (long "
                        "prompts prefill cp times wider) and exchange their new K/V; cp divides ep / dp-attn "
                        "(without --ep a worker is --tp x --cp ranks)")
    g.add_argument("--a2a-backend", default=e.a2a_backend, choices=BACKENDS,
                   help="token dispatch/combine backend between expert-parallel ranks")
    g.add_argument("--dispatch-fp8", action=argparse.BooleanOptionalAction, default=e.dispatch_fp8,
                   help="expert-parallel dispatch sends activations as FP8 e4m3 with one float32 scale per 128 "
                        "hidden columns (about half of bf16's bytes; DeepEP's FP8 dispatch); combine stays in "
                        "--dtype. Meant for GPUs, where dispatch is bandwidth-bound; needs --ep > 1")
    g.add_argument("--deepep-module", default=e.deepep_module,
                   help="the Python module whose Buffer is DeepEP's (deep_ep, or a drop-in fork with its API)")
    g.add_argument("--debug-host-reads", action=argparse.BooleanOptionalAction, default=e.debug_host_reads,
                   help="count each decode step's host reads (device values read on the host: each stalls a GPU "
                        "and breaks graph capture) per DP worker, by file and line; slows every step")
    g.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=e.deterministic,
                   help="batch-invariant output: a request's tokens and logprobs are bitwise the same whatever else "
                        "is batched with it, however its prompt is chunked or cached, on whichever DP worker "
                        "(fixed-order CPU kernels, slower; refuses --quantization, --enable-torch-compile, "
                        "--cpu-experts, --cp, speculative decoding and GPU kernels)")
    g.add_argument("--enable-two-batch-overlap", action=argparse.BooleanOptionalAction,
                   default=e.enable_two_batch_overlap,
                   help="two-batch overlap: split each step's batch by requests into two micro-batches whose MoE "
                        "dispatch/combine is in flight while the other computes attention or experts (backends "
                        "that cannot overlap run the same schedule synchronously); useful with --ep > 1")
    g.add_argument("--max-rank-restarts", type=non_negative_int, default=e.max_rank_restarts,
                   help="when a worker rank dies (one node, ranks this server started, no P/D role): restart the "
                        "ranks and resume every request from its tokens so far, streams open, at most this often "
                        "in 10 minutes; 0: a lost rank ends the server (exit 1) for a supervisor to restart")
    g.add_argument("--num-redundant-experts", type=non_negative_int, default=e.num_redundant_experts,
                   help="extra expert slots per MoE layer for replicas of hot experts")
    g.add_argument("--cache-aware-routing", action=argparse.BooleanOptionalAction, default=e.cache_aware_routing,
                   help="with prefix caching and --dp-attn > 1: send a request to the worker that holds its "
                        "prefix unless its load outweighs the prefill saved")
    g.add_argument("--eplb-interval", type=non_negative_int, default=e.eplb_interval,
                   help="engine steps between expert rebalances; 0 = never")
    g.add_argument("--nnodes", type=positive_int, default=e.nnodes, help="nodes in the job")
    g.add_argument("--node-rank", type=non_negative_int, default=e.node_rank, help="this node's rank")
    g.add_argument("--master-addr", default=e.master_addr, help="rendezvous address (torch.distributed env://)")
    g.add_argument("--master-port", type=tcp_port, default=e.master_port,
                   help="rendezvous port; default: a free one (single node only)")
    g.add_argument("--control-port", type=tcp_port, default=e.control_port,
                   help="port where the front (node 0) takes its ranks' connections; default: master port + 1")
    g.add_argument("--external-workers", dest="launch_workers", action="store_false",
                   help="start no worker here: every rank is started elsewhere, by torchrun running "
                        "'python -m moe_runtime.processes.worker --control-addr A --control-port C' with this job's "
                        "--master-addr A --master-port P and --control-port C, and the shared key")
    g.add_argument("--control-key-file", default=e.control_key_file,
                   help="file holding the secret that ranks of a multi-node or --external-workers job share "
                        f"(default: ${CONTROL_KEY_ENV}; one node: a fresh secret per launch)")
    g.add_argument("--control-heartbeat-timeout", dest="control_heartbeat_timeout_s", type=float,
                   default=e.control_heartbeat_timeout_s,
                   help="seconds a silent node or rank counts as lost on the control plane (unset: "
                        "$MOE_RUNTIME_CONTROL_HEARTBEAT_TIMEOUT, else 20); shorter finds a cut node sooner")

    g = p.add_argument_group("prefill/decode disaggregation (docs/design.md; the router: `moe-serve router --help`)")
    g.add_argument("--disaggregation-mode", default=e.disaggregation_mode, choices=list(DISAGGREGATION_MODES),
                   help="prefill: run prompts and park their KV for decode instances; decode: continue requests "
                        "prefilled elsewhere (both also serve whole requests)")
    g.add_argument("--kv-transfer-host", default=e.kv_transfer_host,
                   help="address this instance's KV sockets bind and the other instances reach")
    g.add_argument("--kv-transfer-key-file", default=e.kv_transfer_key_file,
                   help=f"file holding the secret every instance of a P/D set shares (default: ${KV_KEY_ENV})")
    g.add_argument("--kv-transfer-timeout", dest="kv_transfer_timeout_s", type=float,
                   default=e.kv_transfer_timeout_s,
                   help="seconds parked KV waits to be pulled, and a pull may take, before both are freed")
    g.add_argument("--pd", default=s.pd, metavar="P:D",
                   help="start a whole P/D set on this machine: P prefill and D decode instances (each with the "
                        "other flags given here) behind a router on --host/--port")
    g.add_argument("--pd-prefill-args", default=s.pd_prefill_args, metavar="FLAGS",
                   help='with --pd: extra flags of the prefill instances, e.g. "--ep 2 --dp-attn 1"')
    g.add_argument("--pd-decode-args", default=s.pd_decode_args, metavar="FLAGS",
                   help='with --pd: extra flags of the decode instances, e.g. "--ep 2 --dp-attn 2"')

    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default=s.host, help="address to listen on (0.0.0.0 for every interface)")
    g.add_argument("--port", type=tcp_port, default=s.port, help="port to listen on; 0 picks a free one")
    g.add_argument("--api-key", dest="api_keys", action=AppendToTuple, default=s.api_keys,
                   metavar="KEY",
                   help="require 'Authorization: Bearer <key>' on every route but /health and /metrics "
                        "(a browser opening /dashboard or /docs asks for it as the password); repeat it for "
                        "several tenants: each key's requests then share prefix-cache blocks only among "
                        "themselves")
    g.add_argument("--admin-key", default=s.admin_key, metavar="KEY",
                   help="the operator's key: the routes that act on every tenant (POST /reset_prefix_cache, "
                        "/dashboard/rebalance) then take it and no tenant key; with several --api-key tenants and "
                        "no admin key they are refused to everyone. It opens the other routes too")
    g.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=non_negative_int,
                   default=s.shutdown_timeout_s, metavar="SECONDS",
                   help="on SIGTERM, refuse new requests (503 with Retry-After; /health says draining) and let "
                        "the running ones finish for up to this many seconds, then stop (those still running end "
                        "with an error) and exit 0; keep it under Kubernetes' terminationGracePeriodSeconds "
                        "(30 by default) by a few seconds. 0: stop at once. Ctrl-C and a second SIGTERM stop at once")
    g.add_argument("--max-request-bytes", type=parse_size, default=s.max_request_bytes,
                   help="largest request body accepted, e.g. 4M; larger ones get HTTP 413")
    g.add_argument("--response-store-bytes", type=parse_size, default=s.response_store_bytes, metavar="SIZE",
                   help="memory for the Responses API's stored answers (previous_response_id, GET "
                        "/v1/responses/{id}), all API keys together, e.g. 256M; the oldest go first")
    g.add_argument("--response-ttl", dest="response_ttl_s", type=non_negative_int, default=s.response_ttl_s,
                   metavar="SECONDS", help="how long a stored Responses answer is kept")
    g.add_argument("--log-level", default=s.log_level, choices=["debug", "info", "warning", "error"],
                   help="server and engine log verbosity; info logs one line per finished request, "
                        "debug also uvicorn's access log")
    return p


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**_values_of_fields(ServerConfig, args))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine flags as an EngineConfig; `--model` is the server's choice, resolved at launch."""
    values = _values_of_fields(EngineConfig, args)
    values["model"] = UNRESOLVED_MODEL
    return EngineConfig(**values)


def _values_of_fields(config_class, args: argparse.Namespace) -> dict:
    names = {f.name for f in dataclasses.fields(config_class)}
    return {name: value for name, value in vars(args).items() if name in names}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["router"]:   # `moe-serve router ...`: the P/D router (its own flags)
        from moe_runtime.server.pd_router.cli import main as router_main

        return router_main(argv[1:])
    if argv[:1] == ["plan"]:     # `moe-serve plan ...`: layouts and GPU counts for a model and a load (its own flags)
        from moe_runtime.server.plan_cli import main as plan_main

        return plan_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    print("moe-serve: starting (loading torch and the engine)\n", end="", flush=True)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server_config, engine_config = server_config_from_args(args), engine_config_from_args(args)
    try:
        if server_config.pd is not None:
            from moe_runtime.server.pd_launch import serve_pd_set

            return serve_pd_set(server_config, argv)
        return _serve_or_join(server_config, engine_config)
    except MoERuntimeError as exc:
        parser.exit(2, f"moe-serve: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


def _serve_or_join(server_config: ServerConfig, engine_config: EngineConfig) -> int:
    """Serve (node 0), or start this node's ranks, which get their configuration from the front (other nodes).

    The imports are here, not at the top: they load the engine, which takes seconds (see the module's doc).
    """
    if engine_config.node_rank > 0:
        from moe_runtime.processes.node_launcher import run_worker_node

        server_config.validate()
        engine_config.validate()
        return run_worker_node(engine_config)
    from moe_runtime.server.serve import serve

    return serve(server_config, engine_config)


def console_main() -> None:
    """The `moe-serve` command: `main`, then the exit handlers, then the process's end without the interpreter's
    teardown.

    The teardown's last collection visits every object still alive (torch's and transformers' modules, the
    model, the tokenizer: some 450k) only to find nearly all of them reachable: 2-3 s between "stopped" and the
    process's end, which a restart or a supervisor waits for (freezing them instead makes triton's bindings
    report their objects as leaked at the end). The atexit handlers still run (logging's flush, multiprocessing's
    clean-up of its children), and the standard streams are flushed."""
    code = main()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    console_main()
