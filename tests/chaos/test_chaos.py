"""Short form of the chaos suite (CI): one job on the real service through every fault kind once.

One session (a module fixture) serves the tests: the first checks the pass conditions and that every
kind hit once; the others look at single kinds (a network partition, the etcd and storage outages, the
malformed second job). Where network namespaces cannot be made (no root/CAP_NET_ADMIN, no ``nft``) the
session runs on loopback without partitions and only the partition test is skipped, with the reason.

The long form is ``python -m tests.chaos.runner --faults 50 --seed 1`` (see docs/benchmarks.md). Live recovery
(``--recovery live``: the job spec's ``recovery: live`` and the live-only checks) runs there only: a second
session would double this form's time.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.chaos.runner import ChaosConfig, ChaosReport, Fault, FaultKind, run_chaos
from tests.integration.netns import unavailable_reason

pytestmark = [
    pytest.mark.timeout(720),  # the first test's budget includes the session (~4 min)
    # one worker runs the module (its fixture is the session) and, after it, the namespace tests: their
    # cleanup of stale namespaces must not meet another worker's (tests/parallel.py)
    pytest.mark.xdist_group("netns"),
]
NO_NETNS = unavailable_reason()


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> ChaosReport:
    kinds = tuple(k for k in FaultKind if not (NO_NETNS and k == FaultKind.NETWORK_PARTITION))
    config = ChaosConfig(faults=len(kinds), kinds=kinds, seed=0, time_limit=timedelta(seconds=600), steps_between=8)
    result = run_chaos(config, tmp_path_factory.mktemp("chaos"), netns=NO_NETNS is None)
    print(result.summary())
    return result


def _one(report: ChaosReport, kind: FaultKind) -> Fault:
    faults = [f for f in report.faults if f.kind == kind.value]
    assert len(faults) == 1 and faults[0].settle_s is not None, report.summary()
    return faults[0]


def test_job_completes_exactly_once_with_identical_replicas_through_one_fault_of_each_kind(report: ChaosReport) -> None:
    assert report.passed, report.summary()
    assert sorted(f.kind for f in report.faults) == sorted(report.config["kinds"]), report.summary()
    assert report.resume_points_verified >= 1


@pytest.mark.skipif(NO_NETNS is not None, reason=f"network namespaces unavailable, partitions left out: {NO_NETNS}")
def test_a_partitioned_node_is_dropped_and_rejoins_and_the_job_still_passes(report: ChaosReport) -> None:
    _one(report, FaultKind.NETWORK_PARTITION)
    assert report.network.startswith("netns:") and report.passed, report.summary()


def test_a_full_etcd_outage_of_10_s_is_measured_and_the_job_still_passes(report: ChaosReport) -> None:
    fault = _one(report, FaultKind.ETCD_OUTAGE)
    assert fault.ended is not None and fault.ended - fault.at >= 10.0, report.summary()
    assert fault.impact is not None and "restarted" in fault.impact, report.summary()
    assert report.passed, report.summary()


def test_a_storage_outage_during_a_save_loses_no_committed_snapshot(report: ChaosReport) -> None:
    fault = _one(report, FaultKind.STORAGE_OUTAGE)
    assert "cut during PUT" in fault.target, fault.target  # the outage began with a snapshot upload in flight
    assert not report.checks["no committed snapshot lost in a storage outage"], report.summary()
    assert report.passed, report.summary()


def test_a_malformed_second_job_fails_with_its_error_and_leaves_the_training_job_alone(report: ChaosReport) -> None:
    fault = _one(report, FaultKind.TWO_JOBS)
    assert "ended failed" in fault.detail and "not-a-number" in fault.detail, fault.detail
    assert fault.impact is not None and not fault.impact["restarted"], report.summary()
    assert not report.checks["malformed second job failed, training job unaffected"], report.summary()
