"""`make_engine`: the one place that picks the engine core client for a configuration (`LLM` and `moe-serve`
both use it): one rank in this process, or worker ranks in other processes, behind the same `Front`."""
from __future__ import annotations

import logging
from pathlib import Path

from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.config.model_config import load_hf_config
from moe_runtime.config.multimodal_wrappers import wrapper_of
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.engine.core import EngineCore
from moe_runtime.front.front import Front
from moe_runtime.front.inprocess_client import InProcessClient
from moe_runtime.front.model_options import check_options_for_model
from moe_runtime.front.rank_client import RankClient
from moe_runtime.front.rank_recovery import RankRecovery
from moe_runtime.models.registry import refuse_before_launch
from moe_runtime.weights.tokenizer_files import load_tokenizer

logger = logging.getLogger(__name__)


def make_engine(config: EngineConfig, startup_timeout_s: float = 600.0) -> Front:
    """Options are checked here, so `LLM(...)` refuses an unknown quantization as `moe-serve` does; the
    layout, and the options the model cannot run (`model_options.py`), are checked against the checkpoint
    before any rank starts."""
    config.validate_options()
    hf_config = load_hf_config(config.model)
    check_options_for_model(config, hf_config)
    refuse_before_launch(config, hf_config)   # what the transformers backend cannot run, when it serves the model
    wrapper = wrapper_of(hf_config)
    if wrapper is not None:
        logger.warning("%s: serving its text model (%s); images are not served, its vision tower is not loaded",
                       wrapper.name, wrapper.text_architecture)
    if config.world_size > 1 or config.nnodes > 1 or not config.launch_workers:
        layout = config.layout()
        layout.validate(hf_config)
        transfer_key = (TransferKey.shared(config.kv_transfer_key_file)
                        if config.disaggregation_mode != "none" else None)
        tokenizer = load_tokenizer(Path(config.model))

        def launch() -> RankClient:
            return RankClient(config, layout.world_size, tokenizer, hf_config.vocab_size, transfer_key,
                              startup_timeout_s)

        client = launch()
        relaunch = launch if RankRecovery.can_restart(config) else None   # ranks it did not start can only re-form
    else:
        client, relaunch = InProcessClient(EngineCore(config)), None
    try:
        return Front(config, client, relaunch)
    except BaseException:
        client.shutdown()
        raise
