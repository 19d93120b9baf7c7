"""Node 0 of a two-node job, run inside its network namespace by tests/test_multi_node_elastic.py: the front and
ranks 0-1 (`LLM`), greedy tokens before and after the test takes node 1 away (and, when it brings node 1 back,
once its ranks are back; when it takes node 1 away once more, after that), written as JSON files into OUT.

    python tests/multi_node_driver.py CHECKPOINT OUT MASTER_ADDR MASTER_PORT CONTROL_PORT REDUNDANT_EXPERTS
"""
import json
import sys
import time
from pathlib import Path

from engine_helpers import PROMPTS, greedy
from moe_runtime import LLM
from moe_runtime.errors import EngineDeadError

NEW_TOKENS = 12
GO_TIMEOUT_S = 300


def main(checkpoint: str, out: str, master_addr: str, master_port: str, control_port: str, redundant: str) -> None:
    out_dir = Path(out)
    llm = LLM(checkpoint, device="cpu", dtype="float32", ep=4, dp_attn=4, nnodes=2, node_rank=0,
              master_addr=master_addr, master_port=int(master_port), control_port=int(control_port),
              num_redundant_experts=int(redundant))
    try:
        before = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        (out_dir / "before.json").write_text(json.dumps(before))
        deadline = time.monotonic() + GO_TIMEOUT_S
        while not (out_dir / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            after = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        except EngineDeadError as exc:
            (out_dir / "dead.json").write_text(json.dumps({"error": str(exc), "healthy": llm.engine.health().healthy}))
            return
        (out_dir / "after.json").write_text(json.dumps({"tokens": after, **_state(llm)}))
        deadline = time.monotonic() + GO_TIMEOUT_S
        while not any((out_dir / name).exists() for name in ("back", "done", "again")) and time.monotonic() < deadline:
            time.sleep(0.1)
        if (out_dir / "again").exists():   # node 1 taken away once more (after a first change it rode through)
            again = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
            (out_dir / "again.json").write_text(json.dumps({"tokens": again, **_state(llm)}))
            return
        if (out_dir / "back").exists():   # node 1 restarted: serve until its ranks have rejoined
            while llm.engine.shape.dp_size < 4 and time.monotonic() < deadline:
                llm.generate(PROMPTS[:1], greedy(2))
            tokens = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
            (out_dir / "back.json").write_text(json.dumps({"tokens": tokens, **_state(llm)}))
    finally:
        llm.shutdown()


def _state(llm) -> dict:
    stats = llm.engine.stats().recovery
    health = llm.engine.health()
    return {"reformations": stats.reformations, "lost_ranks": stats.lost_ranks, "returned": stats.returned_ranks,
            "dp_size": llm.engine.shape.dp_size, "healthy": health.healthy, "degraded": health.degraded}


if __name__ == "__main__":
    main(*sys.argv[1:])
