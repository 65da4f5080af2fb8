"""The plan of an etcd cluster inside a Slurm allocation (inprocess.etcd.allocation): which nodes
run a member, what the size survives, the members' command lines and the errors users meet."""

from __future__ import annotations

from pathlib import Path

import pytest

from restartable.inprocess.errors import ConfigError
from restartable.inprocess.etcd.allocation import (
    AllocationCluster,
    default_members,
    sizing_warning,
    tolerated_losses,
)
from restartable.inprocess.etcd.url import parse_url


@pytest.mark.parametrize(
    ("nodes", "members", "losses"),
    [(1, 1, 0), (2, 2, 0), (3, 3, 1), (4, 3, 1), (5, 5, 2), (64, 5, 2)],
)
def test_members_per_allocation_and_what_they_survive(
    nodes: int, members: int, losses: int
) -> None:
    assert default_members(nodes) == members
    assert tolerated_losses(members) == losses


def test_fewer_than_three_members_are_warned_about() -> None:
    one, two = sizing_warning(1), sizing_warning(2)
    assert one is not None and "losing that node loses the store" in one
    assert two is not None and "2 members cannot lose either" in two
    assert all("3 or more nodes" in w for w in (one, two))
    assert sizing_warning(3) is None and sizing_warning(5) is None


def test_url_and_member_command_line_use_each_nodes_own_address() -> None:
    c = AllocationCluster.resolve(["127.0.0.11", "127.0.0.12", "127.0.0.13"], 40010)
    assert c.url() == "etcd://127.0.0.11:40010,127.0.0.12:40010,127.0.0.13:40010"
    assert [h for h, _ in parse_url(c.url()).endpoints] == list(c.addresses)  # the launcher's form
    argv = c.member_argv("127.0.0.12", data_dir=Path("/tmp/d/n2"), token="slurm-7-0")
    assert "--listen-client-urls=http://127.0.0.12:40010" in argv
    assert "--listen-peer-urls=http://127.0.0.12:40011" in argv
    assert "--initial-cluster-token=slurm-7-0" in argv and "--data-dir=/tmp/d/n2" in argv
    with pytest.raises(ConfigError, match="is not one of the etcd members"):
        c.member_argv("127.0.0.14", data_dir=Path("/tmp/d"), token="t")


def test_bad_input_names_the_field_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"node 'no-such-node\.invalid' does not resolve"):
        AllocationCluster.resolve(["no-such-node.invalid"], 40000)
    with pytest.raises(ConfigError, match=r"--port \(65535\) must be in 1\.\.65534"):
        AllocationCluster.resolve(["127.0.0.1"], 65535)
    with pytest.raises(ConfigError, match="at least one"):
        default_members(0)
