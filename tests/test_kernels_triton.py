"""The Triton kernels against their torch twins (the cases live in triton_kernel_cases.py and, for
FP8 weights, fp8_block_triton_cases.py).

With CUDA the cases run here, compiled. Without it they run in the Triton interpreter, which must be
switched on before triton is first imported, and importing transformers' model files (as other test
modules do) already imports triton: so on CPU one test runs the cases in a child pytest process with
TRITON_INTERPRET=1 (both case files in one child: its start-up, torch and triton imports, is a
third of its time), and another checks that asking for Triton kernels on a plain CPU is a clear error.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

CASES = [Path(__file__).with_name(name) for name in ("triton_kernel_cases.py", "fp8_block_triton_cases.py")]

INTERPRETER_CHILD = pytest.StashKey[subprocess.Popen]()


def start_interpreter_child() -> subprocess.Popen:
    """The child pytest that runs the cases in the Triton interpreter (its output goes to pipes read at the end)."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), str(repo / "tests"), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", *map(str, CASES), "-q", "-p", "no:cacheprovider", "--timeout", "300"],
        cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


if torch.cuda.is_available():
    from triton_kernel_cases import *  # noqa: F401,F403  (collected here, compiled on the GPU)
else:
    @pytest.mark.slow
    def test_triton_kernels_in_interpreter_child(request):
        """The child was started when the session's tests were chosen (conftest.py), so its ~40 s ran beside the
        tests before this one; started here if it was not (e.g. this file run on its own)."""
        child = request.config.stash.get(INTERPRETER_CHILD, None) or start_interpreter_child()
        stdout, stderr = child.communicate(timeout=600)
        summary = stdout.strip().splitlines()[-1] if stdout.strip() else ""
        assert child.returncode == 0 and " passed" in summary and "skipped" not in summary, \
            stdout[-8000:] + stderr[-2000:]

    def test_triton_without_cuda_or_interpreter_is_a_clear_error():
        code = ("import kernels\n"
                "try:\n    kernels.get_kernels('cpu', 'triton')\nexcept RuntimeError as e:\n    print('CUDA' in str(e))")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
        assert result.stdout.strip() == "True", result.stderr
