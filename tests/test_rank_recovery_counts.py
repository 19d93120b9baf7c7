"""`moe_lost_ranks_total` counts ranks (red team round 3: three SIGKILLs, one of them during the recovery, left it
at 2). RankRecovery alone, with stand-in clients whose re-formation reports what the real one reports."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from moe_runtime.front.rank_recovery import RankRecovery
from moe_runtime.front.rank_reform import RanksLostMeanwhile, ReformFailed, ReformOutcome


@dataclass
class StandInClient:
    """A job's client: `reform` returns `outcome` or raises `failure`; `shutdown` is recorded."""

    outcome: ReformOutcome | None = None
    failure: ReformFailed | None = None
    reformable: bool = True
    stopped: bool = False

    def reform(self) -> ReformOutcome:
        if self.failure is not None:
            raise self.failure
        return self.outcome

    def shutdown(self) -> None:
        self.stopped = True


def recovered(client: StandInClient, losses: int = 1) -> RankRecovery:
    recovery = RankRecovery(max_restarts=5, relaunch=StandInClient)
    for _ in range(losses):
        assert recovery.begin("rank lost")
        recovery.restart(client)
        recovery.finish(0)
    return recovery


def test_a_rank_killed_while_the_others_re_form_on_one_node_counts():
    """One node: a second rank dies during the re-formation (RanksLostMeanwhile with both), the job restarts."""
    client = StandInClient(failure=RanksLostMeanwhile({1, 3}, "rank 3 lost while re-forming"))
    recovery = recovered(client)
    assert client.stopped and recovery.stats.lost_ranks == 2
    again = recovered(StandInClient(failure=RanksLostMeanwhile({0, 1, 2}, "two more")))
    assert again.stats.lost_ranks == 3


@pytest.mark.parametrize("lost", [1, 2, 4])
def test_every_rank_a_re_formation_goes_on_without_counts(lost):
    """A node's ranks (or ranks lost meanwhile across nodes): the re-formation reports them all."""
    assert recovered(StandInClient(outcome=ReformOutcome(lost=lost))).stats.lost_ranks == lost


def test_ranks_that_come_back_are_not_a_loss_and_repeated_losses_add_up():
    recovery = recovered(StandInClient(outcome=ReformOutcome(lost=2)))
    assert recovery.begin("node 1 is back")
    recovery.restart(StandInClient(outcome=ReformOutcome(returned=2)))
    assert (recovery.stats.lost_ranks, recovery.stats.returned_ranks) == (2, 2)
    assert recovered(StandInClient(outcome=ReformOutcome(lost=1)), losses=3).stats.lost_ranks == 3
