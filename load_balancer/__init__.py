"""Expert-load recording, rebalancing (replication + placement), replica choice."""

from load_balancer.balancedness import balancedness, max_over_mean, mean_over_max, rank_load
from load_balancer.migration import MigrationPlan, plan_migration
from load_balancer.placement import LayerPlacement, Placement, RebalanceStats, static_placement
from load_balancer.rebalance import DEFAULT_GAIN_PER_COPY_ROUND, DEFAULT_LOAD_NOISE, rebalance
from load_balancer.recorder import ExpertLoadRecorder, ExpertLoadSnapshot
from load_balancer.replica_choice import choose_replicas, local_replica_slots
from load_balancer.trace import ExpertLoadTrace, load_trace, save_trace

__all__ = [
    "DEFAULT_GAIN_PER_COPY_ROUND",
    "DEFAULT_LOAD_NOISE",
    "ExpertLoadRecorder",
    "ExpertLoadSnapshot",
    "ExpertLoadTrace",
    "LayerPlacement",
    "MigrationPlan",
    "Placement",
    "RebalanceStats",
    "balancedness",
    "choose_replicas",
    "load_trace",
    "local_replica_slots",
    "max_over_mean",
    "mean_over_max",
    "plan_migration",
    "rank_load",
    "rebalance",
    "save_trace",
    "static_placement",
]
