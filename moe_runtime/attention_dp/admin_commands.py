"""The front's admin commands applied to one rank's core: weight updates, the trainer's group, sleep and wake.

Every rank applies each at the same lock-step boundary and answers `AdminDone` (with its resident memory), so
the front knows when all are done and what each holds. What a command does is the core's (`WeightUpdater`,
`SleepMode`); here it is only turned into the answer, a refusal included (the ranks agree on refusals of
updates before any writes: `engine/weight_updates.py`).
"""
from __future__ import annotations

import logging

from moe_runtime.attention_dp.messages import AdminDone, InitWeightUpdateGroup, SleepEngine, UpdateWeights, WakeUpEngine
from moe_runtime.engine.weight_updates import UpdateApplied, WeightUpdateBroken

logger = logging.getLogger(__name__)

ADMIN_COMMANDS = (UpdateWeights, InitWeightUpdateGroup, SleepEngine, WakeUpEngine)


def apply_admin_command(core, command, rank: int) -> AdminDone:
    """Apply `command` (one of ADMIN_COMMANDS) to `core`; this rank's answer."""
    updater, applied, checksums = core.weight_updater, UpdateApplied(0, False), []
    try:
        if isinstance(command, UpdateWeights):
            if command.specs:
                applied = updater.from_distributed(list(command.specs), command.whole)
            else:
                applied = updater.from_directory(command.path, command.partial, command.whole)
            checksums = updater.slot_checksums() if command.checksums else []
        elif isinstance(command, InitWeightUpdateGroup):
            updater.join_group(command.address)
        elif isinstance(command, SleepEngine):
            core.sleep_mode.sleep(command.level)
        elif isinstance(command, WakeUpEngine):
            core.sleep_mode.wake_up(updater.reload_checkpoint if command.reload else None)
    except WeightUpdateBroken as exc:
        logger.error("rank %d: %s", rank, exc)
        return AdminDone(rank=rank, update_id=command.update_id, error=str(exc), broken=True,
                         memory=core.sleep_mode.memory(rank))
    except Exception as exc:   # noqa: BLE001 - refused before any write (a write's failure is WeightUpdateBroken):
        # the rank stays in its loop and answers, whatever the error's type (safetensors', a backend's)
        logger.warning("rank %d: %s refused: %s", rank, type(command).__name__, exc)
        return AdminDone(rank=rank, update_id=command.update_id, error=str(exc), memory=core.sleep_mode.memory(rank))
    return AdminDone(rank=rank, update_id=command.update_id, tensors=applied.tensors, complete=applied.complete,
                     memory=core.sleep_mode.memory(rank), checksums=checksums)
