"""The Triton FP8 kernel cases, compiled, where CUDA is (on CPU test_kernels_triton.py runs them in its
interpreter child together with the other Triton kernel cases: one child start-up for all).

Collected in a module of their own: a star import replaces the importing module's globals of the same
names (`tolerance`, `HIDDEN`, ...), which test_fp8_block_kernels.py's own tests read.
"""
import pytest
import torch

if torch.cuda.is_available():
    pytest.importorskip("triton")
    from fp8_activation_triton_cases import *  # noqa: F401,F403  (FP8 activations, DeepGEMM's scheme)
    from fp8_block_triton_cases import *  # noqa: F401,F403  (the dequantize scheme)
else:
    def test_the_interpreter_child_runs_the_fp8_cases():
        from test_kernels_triton import CASES

        assert {"fp8_block_triton_cases.py", "fp8_activation_triton_cases.py"} <= {case.name for case in CASES}
