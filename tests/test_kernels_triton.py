"""The Triton kernels against their torch twins (the cases live in triton_kernel_cases.py and, for
FP8 weights, fp8_block_triton_cases.py and fp8_activation_triton_cases.py).

With CUDA the cases run here, compiled. Without it they run in the Triton interpreter, which must be
switched on before triton is first imported, and importing transformers' model files (as other test
modules do) already imports triton: so on CPU one test runs the cases in a child pytest process with
TRITON_INTERPRET=1 (the run's one child, which every module's interpreter cases share:
triton_interpreter_child.py), and another checks that asking for Triton kernels on a plain CPU is a clear error.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_interpreter_child import assert_cases_pass_in_interpreter

pytest.importorskip("triton")

CASES = [Path(__file__).with_name(name) for name in ("triton_kernel_cases.py", "fp8_block_triton_cases.py",
                                                     "fp8_activation_triton_cases.py")]

if torch.cuda.is_available():
    from triton_kernel_cases import *  # noqa: F401,F403  (collected here, compiled on the GPU)
else:
    @pytest.mark.slow
    @pytest.mark.triton_interpreter_cases(*CASES)
    def test_triton_kernels_in_interpreter_child(request):
        assert_cases_pass_in_interpreter(request, CASES)

    def test_triton_without_cuda_or_interpreter_is_a_clear_error():
        code = ("from moe_runtime import kernels\n"
                "try:\n    kernels.get_kernels('cpu', 'triton')\nexcept RuntimeError as e:\n    print('CUDA' in str(e))")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
        assert result.stdout.strip() == "True", result.stderr
