"""The Slurm cluster of tests/slurm/: started once per pytest session (per proctrack plugin),
skipped with the reason where it cannot run (not root, no Slurm packages)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import slurm_cluster


class Clusters:
    """At most one cluster at a time (node names and cgroups are the machine's): ``get``
    closes the running one when another proctrack plugin is asked for."""

    def __init__(self) -> None:
        self.current: slurm_cluster.SlurmCluster | None = None

    def get(self, proctrack: str = "cgroup") -> slurm_cluster.SlurmCluster:
        reason = slurm_cluster.skip_reason()
        if reason is not None:
            pytest.skip(reason)
        if self.current is not None and self.current.proctrack != proctrack:
            self.close()
        if self.current is None:
            self.current = slurm_cluster.SlurmCluster(proctrack=proctrack)
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None


@pytest.fixture(scope="session")
def clusters() -> Iterator[Clusters]:
    owner = Clusters()
    try:
        yield owner
    finally:
        owner.close()


@pytest.fixture
def slurm(clusters: Clusters) -> slurm_cluster.SlurmCluster:
    """The default cluster (proctrack/cgroup)."""
    return clusters.get("cgroup")
