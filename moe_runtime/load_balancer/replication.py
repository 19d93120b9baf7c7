"""How many replicas each logical expert gets."""

from __future__ import annotations

import numpy as np


def greedy_replica_counts(load: np.ndarray, num_slots: int, max_replicas: int) -> np.ndarray:
    """[E] int64 replica counts summing to `num_slots`, each in [1, max_replicas].

    Each redundant slot goes to the expert with the highest load per replica
    that is still below `max_replicas` (no more replicas than ranks that can
    hold them). Without the cap this minimises the largest per-replica load.
    Ties go to the lowest expert id, so the result is deterministic.
    """
    num_experts = load.shape[0]
    if not num_experts <= num_slots <= num_experts * max_replicas:
        raise ValueError(
            f"cannot give {num_experts} experts {num_slots} slots with 1..{max_replicas} replicas each"
        )
    counts = np.ones(num_experts, dtype=np.int64)
    per_replica = load.astype(np.float64).copy()
    for _ in range(num_slots - num_experts):
        candidates = np.where(counts < max_replicas, per_replica, -np.inf)
        expert = int(np.argmax(candidates))
        counts[expert] += 1
        per_replica[expert] = load[expert] / counts[expert]
    return counts
