"""The invariant harness (tests/harness.py) on a fixed seed: N = 1 and N = 3, K = 8."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.etcd_server import EtcdCluster
from tests.harness import Config, Harness

SEED = 20261130


@pytest.mark.parametrize("max_holders", [1, 3])
def test_bounded_concurrency_under_faults(
    etcd: EtcdCluster, tmp_path: Path, max_holders: int, capsys: pytest.CaptureFixture[str]
) -> None:
    report = Harness(Config(seed=SEED, max_holders=max_holders), etcd, tmp_path).run()
    with capsys.disabled():
        print(f"\n[harness] {report.summary()}")
    assert report.faults, "the schedule injected no fault"
    assert report.spans, "no child ever ran"
    assert report.problems == []
