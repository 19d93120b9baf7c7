"""Invalid parallel layouts are rejected before any process starts, with what would work."""
import pytest

from moe_runtime import LLM
from moe_runtime.errors import InvalidRequestError


@pytest.mark.parametrize("arch, kwargs, message", [
    ("mixtral", dict(ep=3), r"ep=3 does not divide the 8 expert slots.*valid ep: \[1, 2, 4, 8\]"),
    ("mixtral", dict(ep=4, dp_attn=3), r"dp_attn=3 must divide ep=4.*\[1, 2, 4\]"),
    ("llama", dict(ep=2), r"dense.*tensor/pipeline"),
    ("mixtral", dict(ep=1, num_redundant_experts=2), r"num_redundant_experts needs ep > 1"),
    ("mixtral", dict(ep=2, num_redundant_experts=1), r"ep=2 does not divide the 9 expert slots"),
])
def test_invalid_layouts_say_what_would_work(arch, kwargs, message, tiny_checkpoint_factory):
    with pytest.raises(InvalidRequestError, match=message):
        LLM(str(tiny_checkpoint_factory(arch)), device="cpu", **kwargs)


def test_heads_not_divisible_by_attention_tp(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("mixtral", num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(InvalidRequestError, match=r"attention TP = ep/dp_attn = 4 does not divide the 6 attention "
                                                  r"heads; with ep=4 use dp_attn in \[2, 4\]"):
        LLM(str(path), device="cpu", ep=4, dp_attn=1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(ep=4, dp_attn=2, cp=4), r"cp=4 must divide the 2 ranks of a DP attention worker.*valid cp: \[1, 2\]"),
    (dict(ep=2, cp=2, enable_two_batch_overlap=True), r"--cp 2 with --enable-two-batch-overlap"),
    (dict(cp=0), r"cp=0: must be >= 1"),
])
def test_invalid_context_parallel_layouts(kwargs, message, tiny_checkpoint_factory):
    with pytest.raises(InvalidRequestError, match=message):
        LLM(str(tiny_checkpoint_factory("mixtral")), device="cpu", **kwargs)


def test_context_parallel_takes_ranks_from_attention_tp():
    from moe_runtime.config.parallel_layout import ParallelLayout

    cases = {  # layout -> (world, DP workers, attention TP)
        ParallelLayout(ep=2, cp=2): (2, 1, 1),
        ParallelLayout(ep=4, dp_attn=2, cp=2): (4, 2, 1),
        ParallelLayout(ep=4, cp=2): (4, 1, 2),
        ParallelLayout(cp=2): (2, 1, 1),               # no EP: the worker is tp x cp ranks
        ParallelLayout(tp=2, cp=2, pp=2): (8, 1, 2),
    }
    for layout, expected in cases.items():
        assert (layout.world_size, layout.dp_size, layout.attn_tp) == expected, layout
