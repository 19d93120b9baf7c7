"""Every torch.distributed collective and point-to-point call in the packages names its group.

An implicit default group is the whole job: with pipeline stages, a call meant for one stage's EP
group would wait on ranks that never join, and a CPU control tensor on the default (NCCL) group
fails on GPU. So each call says `group=` (a data group, or a scope's gloo control group).
"""
import ast
from pathlib import Path

PACKAGES = ("moe_runtime", "attention_dp", "dispatch", "kernels", "load_balancer")
CALLS = {"all_reduce", "broadcast", "all_gather", "all_to_all", "send", "recv", "isend", "irecv", "barrier",
         "reduce_scatter", "gather", "scatter", "all_gather_into_tensor", "all_to_all_single", "batch_isend_irecv",
         "reduce_scatter_tensor", "reduce", "all_gather_object", "broadcast_object_list", "gather_object",
         "scatter_object_list"}
ROOT = Path(__file__).resolve().parent.parent


def calls_without_group(source: str) -> list[tuple[int, str]]:
    """(line, name) of each `dist.<collective>(...)` / `torch.distributed.<collective>(...)` without `group=`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CALLS):
            continue
        owner = ast.unparse(node.func.value)
        if owner in ("dist", "torch.distributed") and not any(k.arg == "group" for k in node.keywords):
            found.append((node.lineno, node.func.attr))
    return found


def test_the_check_finds_calls_without_group():
    source = "dist.all_reduce(x)\ndist.broadcast(x, src=0,\n    group=g)\ntorch.distributed.isend(x, 1)\nother.send(x)\n"
    assert calls_without_group(source) == [(1, "all_reduce"), (4, "isend")]


def test_every_collective_call_names_its_group():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: dist.{name}(...) without group="
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, name in calls_without_group(path.read_text())
    ]
    assert not offenders, "\n".join(offenders)
