"""Each rank announces its dispatch backend once, though the engine builds one dispatcher per phase."""
import logging

from moe_runtime.dispatch import DispatchConfig, make_dispatcher
from moe_runtime.load_balancer import SlotGeometry


def test_one_info_line_per_rank_when_prefill_and_decode_share_the_backend(caplog):
    caplog.set_level(logging.INFO, logger="moe_runtime.dispatch.factory")
    for phase in ("prefill", "decode"):   # what the MoE executor builds on every rank
        make_dispatcher(DispatchConfig("auto", slots=SlotGeometry(num_slots=4, num_ranks=1), rank=0, group=None,
                                       hidden_size=8,
                                       phase=phase, max_tokens_per_rank=16 if phase == "decode" else None))
    announced = [r.getMessage() for r in caplog.records
                 if r.levelno == logging.INFO and r.getMessage().startswith("dispatch backend")]
    assert announced == ["dispatch backend local (asked auto) on rank 0/1, 4 slots"]
