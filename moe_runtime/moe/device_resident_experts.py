"""The hot routed experts of one MoE layer kept on the device while the layer's experts live in host memory.

With `--cpu-experts` a rank's routed experts (`ExpertWeights`, every local slot) are held in host memory and run
by the CPU kernels (moe/host_experts.py). `--device-resident-experts N` also keeps copies of N of those slots on
the device, the ones the load recorder saw take the most tokens (KTransformers keeps hot experts on the GPU the
same way): their rows run on the device, the others on the host. The host stack stays the one `ExpertStore` live
rebalancing reads and commits; the copies are re-taken from it whenever the placement changes (a migration wrote
new experts into host slots) and when the hot set changes, so a copy never holds weights the host slot no longer
has.

Which slots are hot is rank-local: the window of tokens this rank's router sent to each logical expert (the
recorder's own counts, no collective), read at the slot's logical expert.
"""
from __future__ import annotations

import torch

from moe_runtime.moe.expert_weights import ExpertWeights


def hottest_slots(slot_load: torch.Tensor, count: int) -> list[int]:  # slot_load [E_local] -> `count` slots, ascending
    """The `count` local slots with the most load; ties go to the lower slot (a stable order)."""
    order = torch.argsort(-slot_load.to(torch.float64), stable=True)[:count]
    return sorted(order.tolist())


class DeviceResidentExperts:
    """Copies of some local slots of a host `ExpertWeights` on `device`; `slots` ascending (their rows' order)."""

    def __init__(self, host: ExpertWeights, count: int, device: torch.device):
        if not 0 < count <= host.num_local_experts:
            raise ValueError(f"--device-resident-experts {count}: this rank holds {host.num_local_experts} routed "
                             f"experts per MoE layer; choose 1..{host.num_local_experts} (or 0 for none)")
        self.host = host
        self.slots: list[int] = list(range(count))   # until the recorder has seen load: the first slots
        self.copies = ExpertWeights([host.expert_ids[s] for s in self.slots], host.hidden_size,
                                    host.intermediate_size, host.naming, host.w13.dtype if host.quant is None
                                    else _compute_dtype(host), device, host.quant, bias=host.b13 is not None,
                                    activation=host.activation)
        self.stale = True    # the copies are taken before the first step (the weights load after construction)

    @property
    def mask(self) -> torch.Tensor:  # [E_local] bool on the host: which local slots run on the device
        mask = torch.zeros(self.host.num_local_experts, dtype=torch.bool)
        mask[self.slots] = True
        return mask

    def choose(self, slots: list[int]) -> None:
        """Keep these local slots (ascending) on the device from the next `sync` on."""
        if slots != self.slots:
            self.slots = list(slots)
            self.stale = True

    def sync(self) -> None:
        """Copy the chosen slots' weights (scales and biases too) from the host stack, when anything changed."""
        if not self.stale:
            return
        with torch.no_grad():
            for copy, source in zip(self.copies.slot_tensors(), self.host.slot_tensors()):
                copy.copy_(source[self.slots], non_blocking=False)
        self.copies.expert_ids = [self.host.expert_ids[s] for s in self.slots]
        self.stale = False

    def resident_experts(self) -> list[int]:
        """The logical experts whose copies are on the device."""
        return [self.host.expert_ids[s] for s in self.slots]


def _compute_dtype(host: ExpertWeights) -> torch.dtype:
    """A quantized stack's compute dtype: its biases' when it has them, else float32 (unused by the copies)."""
    return host.b13.dtype if host.b13 is not None else torch.float32
