"""The async engine's weight updates, sleep and wake (`AsyncEngine` takes these methods; `LLM`'s are the same
commands through the blocking driver, front/weight_sync.py builds them): one at a time, the running requests
drained (new ones wait, then go on), aborted or paused."""
from __future__ import annotations

import asyncio

from moe_runtime.engine.weight_update_group import JOIN_TIMEOUT_S, GroupAddress
from moe_runtime.front.weight_sync import (AdminResult, check_policy, disk_update, distributed_update, group_join,
                                           remove_written, sleep_command, wake_command, write_tensors)

ADMIN_POLL_S = 0.01   # how often a draining weight update looks whether the running requests have finished


class AsyncAdminCommands:
    """Mixed into `AsyncEngine` (its front, whose `abort` ends a stream, its streams and liveness checks; `_admin_lock` and
    `_admission_resumes`, set in its constructor)."""

    async def update_weights(self, path: str, policy: str = "drain", checksums: bool = False) -> AdminResult:
        return await self._admin(disk_update(path, checksums), policy)

    async def update_weights_from_tensors(self, named_tensors, policy: str = "drain",
                                          checksums: bool = False) -> AdminResult:
        directory = await asyncio.to_thread(write_tensors, named_tensors)
        try:
            return await self._admin(disk_update(directory, checksums, partial=True), policy)
        finally:
            remove_written(directory)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update",
                                        backend: str = "gloo",
                                        timeout_s: float = JOIN_TIMEOUT_S) -> AdminResult:
        address = GroupAddress(str(master_address), int(master_port), int(rank_offset), int(world_size),
                               str(group_name), str(backend), float(timeout_s))
        return await self._admin(group_join(address, self.front.shape.world_size), "pause")

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              policy: str = "drain", checksums: bool = False) -> AdminResult:
        return await self._admin(distributed_update(names, dtypes, shapes, checksums), policy)

    async def sleep(self, level: int = 1) -> AdminResult:
        return await self._admin(sleep_command(level), "drain",
                                 after=lambda result: setattr(self.front.admin, "sleep_level", level))

    async def wake_up(self, reload: bool = False) -> AdminResult:
        return await self._admin(wake_command(reload), "pause",
                                 after=lambda result: setattr(self.front.admin, "sleep_level", 0))

    async def _admin(self, make, policy: str, after=None) -> AdminResult:
        """One admin command at a time; "drain" holds new requests back (they wait, then go on) until the running
        ones finished and the command is done; "abort" ends the running ones now."""
        check_policy(policy)
        self._attach_here()
        self._check_alive()
        if self._admin_lock is None:
            self._admin_lock = asyncio.Lock()
        async with self._admin_lock:
            resumes = None
            if policy == "drain":
                resumes = self._admission_resumes = asyncio.Event()
            try:
                if policy == "drain":
                    while self.front.has_unfinished():
                        self._check_alive()
                        await asyncio.sleep(ADMIN_POLL_S)
                elif policy == "abort":
                    for request_id in list(self._streams):
                        self.front.abort(request_id)
                return await asyncio.wrap_future(self.front.admin_command(make, after))
            finally:
                if resumes is not None:
                    self._admission_resumes = None
                    resumes.set()
