"""The private torch APIs we depend on (``inprocess/_torch_private.py``,
``checkpoint/_torch_private.py``) still behave as we use them.

If one of these fails after a torch upgrade, torch changed a private name or its behaviour: fix
the accessor in the fence module (and only there), or pin torch below the new version in
pyproject.toml. Each test checks what the caller relies on, not only that the name exists.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from restartable.checkpoint import _torch_private as ckpt_private
from restartable.inprocess import _torch_private as inproc_private
from restartable.straggler import _torch_private as straggler_private
from tests.multiproc import free_port


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
    yield store
    if dist.is_initialized():
        dist.destroy_process_group()


def _init(store: dist.Store, prefix: str) -> None:
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=0, world_size=1)


def test_live_groups_lists_the_default_group_and_subgroups_until_destroyed(
    store: dist.TCPStore,
) -> None:
    _init(store, "a")
    sub = dist.new_group([0])
    groups = inproc_private.live_groups()
    before = store.num_keys()
    ckpt_private.default_store().set("probe", "1")
    assert store.num_keys() == before + 1  # the default group's store writes into ``store``
    assert straggler_private.default_store().get("probe") == b"1"
    assert dist.group.WORLD in groups and sub in groups
    assert ckpt_private.is_live_group(sub)
    dist.destroy_process_group()
    assert inproc_private.live_groups() == []
    assert not ckpt_private.is_live_group(sub)


def test_reset_group_counter_names_the_next_default_group_zero(store: dist.TCPStore) -> None:
    _init(store, "a")
    dist.new_group([0])
    dist.new_group([0])
    dist.destroy_process_group()
    inproc_private.reset_group_counter()
    _init(store, "b")
    assert dist.group.WORLD.group_name == "0"


def test_group_backend_is_the_object_that_runs_the_group_on_a_device(store: dist.TCPStore) -> None:
    _init(store, "a")
    backend = inproc_private.group_backend(dist.group.WORLD, torch.device("cpu"))
    assert type(backend).__name__ == "ProcessGroupGloo"  # the NCCL abort asks for "cuda"


def test_module_states_and_dtensor_caches_hold_what_mesh_refs_releases(
    store: dist.TCPStore,
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(store, "a")
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    assert any(s is fully_shard.state(model) for s in inproc_private.module_states())
    model(torch.randn(2, 4)).sum().backward()  # DTensor ops: fills the caches
    assert isinstance(inproc_private.redistribute_planners(), list)
    inproc_private.clear_dtensor_sharding_caches()
    assert inproc_private.redistribute_planners() == []


def test_flatten_state_dict_gives_dotted_keys() -> None:
    flat, mapping = ckpt_private.flatten_state_dict({"model": {"w": torch.ones(2)}, "step": 3})
    assert set(flat) == {"model.w", "step"}
    assert mapping["model.w"] == ("model", "w")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_fsspec_storage_classes_round_trip_a_dcp_checkpoint() -> None:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0)}
    url = "memory://restartable-torch-private/ckpt"
    dcp.save(state, storage_writer=ckpt_private.fsspec_writer_class()(url), no_dist=True)
    out = {"w": torch.zeros(6)}
    dcp.load(out, storage_reader=ckpt_private.fsspec_reader_class()(url), no_dist=True)
    assert torch.equal(out["w"], state["w"])


def test_save_without_crc_is_read_back_by_torch_load() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    buf = io.BytesIO()
    ckpt_private.save_without_crc(t, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=True), t)


def test_version_counter_counts_in_place_writes_but_not_through_data() -> None:
    """What the overlapped snapshot's race check sees (checkpoint/local/overlap.py): in-place
    writes, also under no_grad and through a state_dict's detached tensor, but not writes
    through ``.data`` (docs/checkpoint.md says so)."""
    p = torch.nn.Parameter(torch.zeros(4))
    seen = p.detach()  # what state_dict() holds
    before = ckpt_private.version_counter(seen)
    _ = p + 1  # a read
    assert ckpt_private.version_counter(seen) == before
    with torch.no_grad():
        p.add_(1)
    assert ckpt_private.version_counter(seen) == before + 1
    p.data.mul_(2)
    assert ckpt_private.version_counter(seen) == before + 1


def test_foreach_copy_copies_every_pair() -> None:
    srcs = [torch.ones(3), torch.full((2,), 7.0)]
    dsts = [torch.zeros(3), torch.zeros(2)]
    ckpt_private.foreach_copy(dsts, srcs, non_blocking=False)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))


def test_split_write_items_and_storage_info_match_dcp_filesystem_writer() -> None:
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

    plan = create_default_local_save_plan({"a": torch.ones(4), "b": torch.zeros(2)}, True)
    buckets = ckpt_private.split_write_items(2, plan.items)
    assert sorted(i.index.fqn for b in buckets for i in b) == ["a", "b"]
    info = ckpt_private.storage_info("__0_0.distcp", 8, 16)
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 8, 16)


def _row_sharded(store: dist.TCPStore, prefix: str, shape: tuple[int, int]) -> Any:
    """A DTensor of `shape` (values 0, 1, ...) sharded by rows on a one-rank CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    _init(store, prefix)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    return distribute_tensor(torch.arange(float(shape[0] * shape[1])).reshape(shape), mesh,
                             [Shard(0)])  # fmt: skip


def test_dtensor_with_local_keeps_the_given_local_tensor_and_the_sharding(
    store: dist.TCPStore,
) -> None:
    from torch.distributed.tensor import DTensor

    live = _row_sharded(store, "d", (3, 4))
    host = torch.full((3, 4), 7.0)
    d = ckpt_private.dtensor_with_local(host, live)
    assert isinstance(d, DTensor)
    # The very tensor given (the staging buffer), not a copy on the mesh's device.
    assert d.to_local() is host or d.to_local().data_ptr() == host.data_ptr()
    assert (d.device_mesh, d.placements, d.shape, d.stride()) == (
        live.device_mesh,
        live.placements,
        live.shape,
        live.stride(),
    )
    assert torch.equal(d.full_tensor(), host)


def test_dtensor_local_and_spec_are_what_to_local_and_the_placements_say(
    store: dist.TCPStore,
) -> None:
    d = _row_sharded(store, "e", (3, 2))
    local, spec = ckpt_private.dtensor_local_and_spec(d)
    with torch.no_grad():
        assert local is d.to_local()
    assert (spec.mesh, spec.placements) == (d.device_mesh, d.placements)
