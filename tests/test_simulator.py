"""The recipe's simulator: its model of etcd checked against a real etcd, then the
recipe's machines driven through seeded schedules with every property checked at each step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.etcd_server import EtcdCluster
from tests.sim.model import SimEtcd
from tests.sim.real import RealEtcd
from tests.sim.scenarios import SCENARIOS


@pytest.fixture
def fresh_etcd(tmp_path: Path) -> Iterator[RealEtcd]:
    """A real etcd of its own, empty, at revision 1 (the scenarios compare revisions)."""
    cluster = EtcdCluster(tmp_path / "etcd")
    cluster.start()
    real = RealEtcd(cluster.members[0].endpoint)
    try:
        yield real
    finally:
        real.close()
        cluster.stop()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_model_answers_as_etcd_does(scenario: str, fresh_etcd: RealEtcd) -> None:
    expected = SCENARIOS[scenario](fresh_etcd)
    assert SCENARIOS[scenario](SimEtcd()) == expected
