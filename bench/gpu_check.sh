#!/usr/bin/env bash
# GPU check of moe-runtime: every GPU code path once, with JSON evidence, in under 10 minutes on one H200.
#
# What it runs (python -m bench.gpu_check: the package bench/gpu_check/; budgets in its supervisor.py):
#   part          expected  hard limit  what
#   environment      10 s       60 s    versions, the GPU, the packages the parts import
#   kernels          80 s      150 s    every Triton kernel vs its torch twin at DeepSeek-V3 shapes, bf16
#                                       (hidden 7168, 256 experts top-8, moe_intermediate 2048, MLA 576/512)
#   attention        60 s      150 s    varlen paged prefill + split-context decode (Triton, FlashInfer where it
#                                       imports) vs the torch twins at DeepSeek-V3 MLA / Llama GQA shapes, timed
#   parity          100 s      170 s    LLM(device="cuda") vs transformers, all 10 tiny architectures:
#                                       fp32 tokens exact, bf16 close; ep=2 when 2 GPUs are visible
#   serve            40 s      100 s    moe-serve --device cuda on the demo model answers a completion
#   moe_layer        50 s      120 s    bench/bench_moe_layer.py in bf16 vs transformers' MoE block
#   offline          70 s      140 s    offline generation vs transformers generate (bf16 and --quantization
#                                       fp8, batch 1 and 16)
#   captured         90 s      180 s    --enable-torch-compile on CUDA: decode replayed as CUDA graphs gives the
#                                       eager tokens (qwen3_moe, deepseek_v3), no graph skipped; ms/token vs eager
#   captured_ep      90 s      180 s    ep=2, --a2a-backend deepep: zero host reads in decode steps; the EP step
#                                       captured whole (DeepEP low latency inside) gives eager's tokens; skipped
#                                       (with the reason) without 2 GPUs and deep_ep
#   cpu_experts      40 s      100 s    --cpu-experts: routed experts in host memory (two hot ones kept on the
#                                       device) give the all-on-device tokens; ms/token offloaded vs on device
#   kernel_cases     60 s      120 s    tests/triton_kernel_cases.py compiled (edge cases, bf16 + fp32)
#   total           ~9 min (estimates: no GPU has run it yet). The run stops starting parts at 540 s
#                   (--total-timeout; less what the wheels took) and this script kills it at
#                   GPU_CHECK_HARD_LIMIT_S (default 580 s); results are written after each part.
# Most of a cold run is Triton compiling each kernel variant once; a part far over its budget is itself
# a finding (printed as OVER BUDGET). Each part runs in its own process: a check that fails, raises or
# crashes the process (a CUDA illegal memory access) is recorded and the run goes on.
#
# Results: bench/results/gpu_check.json (a partial run: gpu_check_only-<parts>.json; the dry run:
# gpu_check_dry_run.json, never GPU evidence), pass/fail per check and a summary; the log beside it
# (gpu_check.log, git-ignored). With $OUT set (the device tool's output folder) both are copied there.
# Exit status 0 = every check passed or was skipped with its reason; 1 = something failed; 2 = no GPU.
#
# On a lent GPU machine with no network (the device session, one command):
#   1. here, once:   python -m bench.gpu_check.environment   # 27 MiB of wheels into bench/.cache/wheels
#                    (the serving stack, transformers 5.24: what a bare CUDA image lacks); they are
#                    installed below into /tmp/gpu_check_site, first on PYTHONPATH
#   2. device run:   command  "bash bench/gpu_check.sh"   carry ["bench/.cache/wheels"]   timeout_s 600
#      (with less device time left than the run needs, say GPU_CHECK_HARD_LIMIT_S=<seconds> in the command:
#      the parts that fit run, the JSON says which did not)
#      a rerun of what failed, if device time is left:  "bash bench/gpu_check.sh --only parity,serve"
#   3. then copy the JSON from the run's files into bench/results/ and commit it.
# Rehearsal on any CPU machine (Triton in its interpreter, small shapes, 2 of the 10 architectures; about
# 1.5 min of CPU work, 3.5 min wall on the 2-core dev machine shared with other jobs):
#   bash bench/gpu_check.sh --dry-run          (or GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh)
# Other flags: --tiny (smallest subset), --skip PARTS, --total-timeout S, --list (parts and budgets).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="${PYTHON:-python3}"
WHEELS="bench/.cache/wheels"
SITE="/tmp/gpu_check_site"
HARD_LIMIT_S="${GPU_CHECK_HARD_LIMIT_S:-580}"
started=$(date +%s)
marker=$(mktemp)

dry_run="${GPU_CHECK_DRY_RUN:-0}"
for arg in "$@"; do [[ "$arg" == "--dry-run" ]] && dry_run=1; done
if [[ "$dry_run" == 1 || "$dry_run" == true ]]; then log="bench/results/gpu_check_dry_run.log"; else log="bench/results/gpu_check.log"; fi
mkdir -p bench/results

extra_path=""
py_tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
foreign=$(ls "$WHEELS"/*-cp3*.whl 2> /dev/null | grep -v -- "-$py_tag-" | head -1)
if [[ "$dry_run" == 1 || "$dry_run" == true || " $* " == *" --list "* ]] || ! compgen -G "$WHEELS/*.whl" > /dev/null; then
    :                                                   # nothing to install, or not needed
elif [[ -n "$foreign" ]]; then
    echo "not installing $WHEELS: built for another Python than this $py_tag ($(basename "$foreign"))"
else
    echo "installing the carried wheels ($(ls "$WHEELS"/*.whl | wc -l)) into $SITE"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$WHEELS"/*.whl 2>&1 | tail -5; then
        extra_path="$SITE"
    else
        echo "installing the wheels failed: the environment part will name what is missing"
    fi
fi
export PYTHONPATH="${extra_path:+$extra_path:}$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# The Python side stops starting parts early enough to write its results before the hard limit,
# counting the time the wheels took (unless --total-timeout says otherwise).
total_args=()
if [[ " $* " != *" --total-timeout"* ]]; then
    left=$(( HARD_LIMIT_S - ($(date +%s) - started) - 25 ))
    default_total=540; [[ "$dry_run" == 1 || "$dry_run" == true ]] && default_total=420
    total_args=(--total-timeout "$(( left < default_total ? left : default_total ))")
fi
timeout -k 10 "$(( HARD_LIMIT_S - ($(date +%s) - started) ))" "$PY" -m bench.gpu_check ${total_args[@]+"${total_args[@]}"} "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
[[ $status == 124 || $status == 137 ]] && echo "gpu_check.sh: killed at GPU_CHECK_HARD_LIMIT_S=${HARD_LIMIT_S}s; the JSON holds the parts that finished"
echo "gpu_check.sh: exit $status after $(( $(date +%s) - started )) s"

if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then
    find bench/results -maxdepth 1 -name 'gpu_check*.json' -newer "$marker" -exec cp {} "$OUT"/ \;
    cp "$log" "$OUT"/
fi
rm -f "$marker"
exit "$status"
