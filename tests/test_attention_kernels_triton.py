"""The Triton attention kernels (varlen paged prefill, split-context decode) and the attention seam through them
(the cases live in attention_triton_cases.py).

With CUDA the cases run here, compiled. On CPU they run in the Triton interpreter, which must be switched on
before triton is first imported (importing transformers' model files, as other test modules do, imports it):
so one test runs them in a child pytest process with TRITON_INTERPRET=1 (as test_kernels_triton.py does).
"""
from pathlib import Path

import pytest
import torch
from triton_interpreter_child import assert_cases_pass_in_interpreter

pytest.importorskip("triton")

CASES = Path(__file__).with_name("attention_triton_cases.py")

if torch.cuda.is_available():
    from attention_triton_cases import *  # noqa: F401,F403  (collected here, compiled on the GPU)
else:
    @pytest.mark.slow
    @pytest.mark.triton_interpreter_cases(CASES)
    def test_attention_kernels_in_interpreter_child(request):
        assert_cases_pass_in_interpreter(request, [CASES])
