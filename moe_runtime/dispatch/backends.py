"""The dispatch backends and step phases by name (no torch: `moe-serve --help` lists them)."""

BACKEND_AUTO = "auto"
BACKEND_LOCAL = "local"
BACKEND_ALL_TO_ALL = "all_to_all"
BACKEND_ALLGATHER = "allgather"
BACKEND_DEEPEP = "deepep"                          # normal or low-latency, chosen by phase
BACKEND_DEEPEP_NORMAL = "deepep_normal"            # throughput kernels (prefill)
BACKEND_DEEPEP_LOW_LATENCY = "deepep_low_latency"  # masked layout, bounded tokens (decode)

BACKENDS = (BACKEND_AUTO, BACKEND_LOCAL, BACKEND_ALL_TO_ALL, BACKEND_ALLGATHER, BACKEND_DEEPEP,
            BACKEND_DEEPEP_NORMAL, BACKEND_DEEPEP_LOW_LATENCY)

PHASE_PREFILL = "prefill"
PHASE_DECODE = "decode"
PHASES = (None, PHASE_PREFILL, PHASE_DECODE)
