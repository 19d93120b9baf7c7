"""What a newcomer gets: a scratch venv resolving today's registry versions, Hugging Face's `kernels` beside us.

One venv, built once: torch's CPU build (this suite's own, linked in as an installed distribution, as the
README's first step leaves it: unpacking the same 700 MB wheel again would only cost time), then this
checkout as a built wheel installed non-editable (the
C++ kernel sources and the dashboard's files must travel in it) together with Hugging Face's `kernels`,
whatever transformers pip resolves now. `moe-serve` is started from a directory outside the repository
and answers a completion, and transformers runs a model in the same environment. Then the same venv takes
the checkout as an editable install and serves again from outside. Slow: it installs packages (minutes).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest

from server_harness import REPO_ROOT, InstalledMoeServe, ServerProcess

pytestmark = pytest.mark.slow

PIP_TIMEOUT_S = 600
# No byte-compiling of everything installed (half of the install's time, mostly transformers' thousands of
# files): what a server or a script imports is compiled as it is imported, as in any venv.
PIP_INSTALL = ("--quiet", "--no-compile")

# Run inside the scratch venv: the packages it resolved, and where each import name comes from.
ENVIRONMENT_REPORT = """
import importlib.metadata, json, kernels, transformers
import transformers.integrations.hub_kernels
import moe_runtime.kernels, moe_runtime.server
from moe_runtime.kernels.cpu_native.build import HEADERS, SOURCE
from moe_runtime.server.dashboard.routes import STATIC_DIR
print(json.dumps({
    "transformers": transformers.__version__, "kernels_version": importlib.metadata.version("kernels"),
    "hub_kernels_file": kernels.__file__, "hub_has_get_kernel": hasattr(kernels, "get_kernel"),
    "our_kernels_file": moe_runtime.kernels.__file__,
    "cpu_sources": [p.is_file() for p in (SOURCE, *HEADERS)],
    "static_files": sorted(p.name for p in STATIC_DIR.iterdir()),
}))
"""

# A transformers model in the same environment: a tiny random Llama, generated greedily (run after the report, in
# the same process: torch and transformers are imported once).
TRANSFORMERS_RUN = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
out = model.generate(torch.tensor([[1, 5, 9, 3]]), max_new_tokens=4, do_sample=False)
print(out.shape[1])
"""


def run(command: list[str], cwd: Path, timeout_s: float = PIP_TIMEOUT_S) -> str:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def copy_checkout(destination: Path) -> Path:
    """The checkout's files as git sees them (tracked and new, not ignored), so no build output lands in it."""
    listed = run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], REPO_ROOT, 60)
    for name in filter(None, listed.split("\0")):
        source = REPO_ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def link_torch(venv: Path) -> None:
    """torch as installed here, linked into `venv`'s site-packages: its packages and its dist-info, so pip sees
    it installed (and resolves its requirements itself)."""
    torch_dist = importlib.metadata.distribution("torch")
    installed_in = Path(torch_dist.locate_file(""))
    site = venv / Path(sysconfig.get_path("purelib", vars={"base": str(venv)})).relative_to(venv)
    top_level = (torch_dist.read_text("top_level.txt") or "torch").split()
    dist_info = next(installed_in.glob(f"torch-{torch_dist.version}.dist-info"))
    for name in [*top_level, dist_info.name]:
        (site / name).symlink_to(installed_in / name)


def completes(installed: InstalledMoeServe, layout: tuple[str, ...] = ("--dp-attn", "2", "--ep", "2")) -> str:
    with ServerProcess(list(layout), installed=installed, startup_timeout_s=240) as server:
        reply = httpx.post(server.base_url + "/v1/completions", timeout=120,
                           json={"model": "moe-runtime-demo", "prompt": "Once upon a time", "max_tokens": 6})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 6
        page = httpx.get(server.base_url + "/dashboard", timeout=30)
        assert page.status_code == 200 and "<html" in page.text.lower()
        return reply.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("fresh_install")
    venv = root / "venv"
    run([sys.executable, "-m", "venv", str(venv)], root, 120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", *PIP_INSTALL]
    link_torch(venv)   # the CPU build this suite runs on
    checkout = copy_checkout(root / "checkout")
    run([str(venv / "bin" / "python"), "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(root / "wheels"),
         str(checkout)], root)
    wheel, = (root / "wheels").glob("moe_runtime-*.whl")
    run([*pip, str(wheel), "kernels"], root)
    outside = root / "elsewhere"
    outside.mkdir()
    return venv, checkout, outside


def test_the_wheel_serves_beside_hf_kernels_and_transformers_still_runs(scratch):
    venv, _, outside = scratch
    python = str(venv / "bin" / "python")
    report_line, generated_length = run([python, "-c", ENVIRONMENT_REPORT + TRANSFORMERS_RUN], outside,
                                        300).splitlines()
    report = json.loads(report_line)
    assert report["hub_has_get_kernel"], report                       # `import kernels` is Hugging Face's
    assert "site-packages/moe_runtime/kernels" in report["our_kernels_file"], report   # ours, from the wheel
    assert all(report["cpu_sources"]), report                         # the C++ sources travelled as package data
    assert {"index.html", "dashboard.js", "plan.js", "dashboard.css"} <= set(report["static_files"]), report
    assert generated_length == "8"                                    # transformers runs a model beside us
    completes(InstalledMoeServe(venv / "bin" / "moe-serve", outside))


def test_an_editable_install_serves_from_another_directory(scratch):
    venv, checkout, outside = scratch
    run([str(venv / "bin" / "python"), "-m", "pip", "install", *PIP_INSTALL, "--no-deps", "-e", str(checkout)], outside)
    report = json.loads(run([str(venv / "bin" / "python"), "-c", ENVIRONMENT_REPORT], outside, 120))
    assert Path(report["our_kernels_file"]).resolve() == (checkout / "moe_runtime" / "kernels" / "__init__.py").resolve(), report
    assert report["hub_has_get_kernel"], report
    completes(InstalledMoeServe(venv / "bin" / "moe-serve", outside), layout=())   # one rank: the install is the point
