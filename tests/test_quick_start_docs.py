"""The README's quick start, `.ci/run` and `python -m moe_runtime.processes.worker --help` say the same things as the code."""
import re
from pathlib import Path

from moe_runtime.demo import demo_model as demo
from moe_runtime.processes import worker
from moe_runtime.server.server_config import DEMO_SERVED_NAME

REPO_ROOT = Path(__file__).resolve().parents[1]
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def readme_section(title: str) -> str:
    text = (REPO_ROOT / "README.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def words(text: str) -> str:
    """`text` with markdown backticks, shell line continuations and runs of white space flattened."""
    return " ".join(text.replace("`", " ").replace("\\\n", " ").split())


def ci_commands() -> list[str]:
    return [line.strip() for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_ci_installs_the_cpu_torch_the_readme_names_without_pytorchs_index():
    torch_installs = [line for line in ci_commands() if re.search(r"pip install (--quiet )?\"?torch==", line)]
    assert len(torch_installs) == 1
    version = re.search(r"torch==([\w.]+)\+cpu", torch_installs[0]).group(1)   # the CPU build, explicitly
    assert not any(PYTORCH_CPU_INDEX in line for line in ci_commands())       # CI cannot reach it
    quick_start = readme_section("Quick start")
    assert f"pip install torch=={version} --extra-index-url {PYTORCH_CPU_INDEX}" in quick_start
    assert f"torch=={version}+cpu" in quick_start


def test_quick_start_is_two_commands_install_and_serve_then_test():
    quick_start = readme_section("Quick start")
    block = quick_start[quick_start.index("```bash") + 7: quick_start.index("```", quick_start.index("```bash") + 7)]
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2, commands
    assert "pip install" in commands[0] and commands[0].rstrip().endswith("moe-serve --dp-attn 2 --ep 2")
    assert commands[1].strip() == "python -m pytest -q"
    ci = ci_commands()
    assert any(line.startswith("python -m pytest -q") for line in ci)   # CI runs the README's test command ...
    assert 'pip install -e ".[dev]"' in ci[ci.index("source \"$SCRATCH/newest/bin/activate\"") + 1]   # ... in a
    assert any(line.startswith("python3 -m venv") for line in ci)   # new venv, after exactly the README's install


def test_ci_installs_chromium_when_either_part_is_missing():
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "/usr/bin/chromium ]" in ci and "/usr/bin/chromedriver ]" in ci and "chromium chromium-driver" in ci


def test_quick_start_asks_the_demo_by_its_served_name_with_curl_and_openai():
    quick_start = readme_section("Quick start")
    assert f'"model": "{DEMO_SERVED_NAME}"' in quick_start                 # the curl call
    assert f'model="{DEMO_SERVED_NAME}"' in quick_start                    # the openai client's
    assert "seeded random weights" in quick_start and "second terminal" in quick_start


def test_serving_documents_the_demo_cache_as_demo_py_implements_it():
    serving = readme_section("Serving: `moe-serve`")
    assert f"${demo.CACHE_ENV}/{demo.DEMO_NAME}" in serving
    assert f"~/.cache/moe_runtime/{demo.DEMO_NAME}" in serving
    assert "python -m moe_runtime.demo.demo_model DIR" in serving


def test_readme_and_worker_help_start_a_torchrun_job_the_same_way():
    serving = words(readme_section("Serving: `moe-serve`"))
    worker_help = words(worker.main.__doc__)
    front = "moe-serve ... --external-workers --master-addr A --master-port P --control-port C"
    ranks = ("torchrun --nnodes N --nproc-per-node R --master-addr A --master-port P -m moe_runtime.processes.worker "
             "--control-addr A --control-port C")
    for command in (front, ranks):
        assert command in serving and command in worker_help


def test_tests_section_says_how_long_and_how_to_skip_the_slow_tests():
    tests = readme_section("Tests")
    assert "python -m pytest -q" in tests and '-m "not slow"' in tests and "minutes" in tests


def test_readme_stays_short_and_its_reference_pages_exist():
    """At most 300 lines: the quick start, what it serves and where to read on; reference material in docs/."""
    readme = (REPO_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for page in re.findall(r"\]\((docs/[\w./-]+\.md)\)", readme):
        assert (REPO_ROOT / page).is_file(), page
