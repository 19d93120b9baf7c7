"""The GPU check of moe-runtime: `bash bench/gpu_check.sh` (or `python -m bench.gpu_check`); see __main__.py.

    __main__.py       the run: arguments, the parts in order, the report written after each part
    report.py         RunMode, a check's Outcome and the Part protocol, the results and the report
    supervisor.py     the parts and their budgets (PARTS); each part in its own processes
    environment.py    part `environment`; `python -m bench.gpu_check.environment` downloads the wheels
    kernels.py        part `kernels`: every Triton kernel vs its torch twin
    kernel_shapes.py  its shapes, tolerances, inputs, comparison and timing
    models.py         parts `parity`, `offline`, `captured`: the runtime's tokens vs transformers and eager
    programs.py       parts `serve`, `moe_layer`, `kernel_cases`: a program of the repository run as it is
"""
