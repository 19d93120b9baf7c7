"""The Triton attention kernels (varlen paged prefill, split-context decode) and the attention seam through them
(the cases live in attention_triton_cases.py).

With CUDA the cases run here, compiled. On CPU they run in the Triton interpreter, which must be switched on
before triton is first imported (importing transformers' model files, as other test modules do, imports it):
so one test runs them in a child pytest process with TRITON_INTERPRET=1 (as test_kernels_triton.py does).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

CASES = Path(__file__).with_name("attention_triton_cases.py")

if torch.cuda.is_available():
    from attention_triton_cases import *  # noqa: F401,F403  (collected here, compiled on the GPU)
else:
    @pytest.mark.slow
    def test_attention_kernels_in_interpreter_child():
        repo = Path(__file__).resolve().parents[1]
        env = {**os.environ, "TRITON_INTERPRET": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), str(repo / "tests"), os.environ.get("PYTHONPATH")]))}
        env.pop("MOE_ATTENTION_BACKEND", None)
        result = subprocess.run(
            [sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider", "--timeout", "300"],
            cwd=repo, env=env, capture_output=True, text=True, timeout=600,
        )
        summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
        assert result.returncode == 0 and " passed" in summary and "skipped" not in summary, \
            result.stdout[-8000:] + result.stderr[-2000:]
