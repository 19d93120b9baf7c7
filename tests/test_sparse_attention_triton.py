"""DeepSeek Sparse Attention's Triton kernel and the sparse MLA layer through it (the cases live in
sparse_attention_triton_cases.py): compiled here with CUDA; on CPU in a child pytest process with
TRITON_INTERPRET=1 (the interpreter is chosen when triton is first imported)."""
from pathlib import Path

import pytest
import torch
from triton_interpreter_child import assert_cases_pass_in_interpreter

pytest.importorskip("triton")

CASES = Path(__file__).with_name("sparse_attention_triton_cases.py")

if torch.cuda.is_available():
    from sparse_attention_triton_cases import *  # noqa: F401,F403  (collected here, compiled on the GPU)
else:
    @pytest.mark.slow
    @pytest.mark.triton_interpreter_cases(CASES)
    def test_sparse_attention_kernel_in_interpreter_child(request):
        assert_cases_pass_in_interpreter(request, [CASES])
