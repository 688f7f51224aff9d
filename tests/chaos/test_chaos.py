"""Short form of the chaos suite (CI): one job on the real service through every fault kind once.

One session (a module fixture) serves both tests: the first checks the pass conditions and that every
kind hit once; the second that a network partition was among them. Where network namespaces cannot be
made (no root/CAP_NET_ADMIN, no ``nft``) the session runs on loopback without partitions and only the
second test is skipped, with the reason.

The long form is ``python -m tests.chaos.runner --faults 50 --seed 1`` (see docs/benchmarks.md).
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.chaos.runner import ChaosConfig, ChaosReport, FaultKind, run_chaos
from tests.integration.netns import unavailable_reason

pytestmark = pytest.mark.timeout(540)  # the first test's budget includes the session (~2 min)
NO_NETNS = unavailable_reason()


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> ChaosReport:
    kinds = tuple(k for k in FaultKind if not (NO_NETNS and k == FaultKind.NETWORK_PARTITION))
    config = ChaosConfig(
        faults=len(kinds), kinds=kinds, seed=0, time_limit=timedelta(seconds=450), steps_between=8
    )
    result = run_chaos(config, tmp_path_factory.mktemp("chaos"), netns=NO_NETNS is None)
    print(result.summary())
    return result


def test_job_completes_exactly_once_with_identical_replicas_through_one_fault_of_each_kind(report: ChaosReport) -> None:
    assert report.passed, report.summary()
    assert sorted(f.kind for f in report.faults) == sorted(report.config["kinds"]), report.summary()
    assert report.resume_points_verified >= 1


@pytest.mark.skipif(NO_NETNS is not None, reason=f"network namespaces unavailable, partitions left out: {NO_NETNS}")
def test_a_partitioned_node_is_dropped_and_rejoins_and_the_job_still_passes(report: ChaosReport) -> None:
    partitions = [f for f in report.faults if f.kind == FaultKind.NETWORK_PARTITION.value]
    assert len(partitions) == 1 and partitions[0].settle_s is not None, report.summary()
    assert report.network.startswith("netns:") and report.passed, report.summary()
