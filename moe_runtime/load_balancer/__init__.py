"""Expert placement and its balancing: slot geometry, placements, replica choice on the step path,
expert-load recording, rebalancing (replication + placement), live migration through `ExpertStore`."""


from moe_runtime.load_balancer.balancedness import balancedness, max_over_mean, mean_over_max, rank_load
from moe_runtime.load_balancer.expert_store import ExpertStore
from moe_runtime.load_balancer.migration import MigrationPlan, plan_migration
from moe_runtime.load_balancer.placement import Placement, RebalanceStats, static_placement
from moe_runtime.load_balancer.rebalance import DEFAULT_GAIN_PER_COPY_ROUND, DEFAULT_LOAD_NOISE, rebalance
from moe_runtime.load_balancer.rebalance_event import RebalanceEvent
from moe_runtime.load_balancer.recorder import ExpertLoadRecorder, ExpertLoadSnapshot
from moe_runtime.load_balancer.replica_choice import ReplicaTable, choose_replicas, local_replica_slots, replica_tables
from moe_runtime.load_balancer.slot_geometry import SlotGeometry
from moe_runtime.load_balancer.trace import ExpertLoadTrace, load_trace, save_trace

__all__ = [
    "DEFAULT_GAIN_PER_COPY_ROUND",
    "DEFAULT_LOAD_NOISE",
    "ExpertLoadRecorder",
    "ExpertLoadSnapshot",
    "ExpertLoadTrace",
    "ExpertStore",
    "MigrationPlan",
    "Placement",
    "RebalanceEvent",
    "RebalanceStats",
    "ReplicaTable",
    "SlotGeometry",
    "balancedness",
    "choose_replicas",
    "load_trace",
    "local_replica_slots",
    "max_over_mean",
    "mean_over_max",
    "plan_migration",
    "rank_load",
    "rebalance",
    "replica_tables",
    "save_trace",
    "static_placement",
]
