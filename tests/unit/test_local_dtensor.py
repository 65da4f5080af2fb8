"""Local-tier packing of DTensor state (FSDP2 / TP): local shards in place, sharding as JSON."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from restartable.checkpoint.errors import ShardingMismatchError
from restartable.checkpoint.local import packing, unpacking, walk


def _pack(state: dict[str, Any]) -> torch.Tensor:
    leaves = walk.leaves(state, [])
    tensors = [x for x in leaves if isinstance(x.value, torch.Tensor)]
    objects = {x.key: x.value for x in leaves if not isinstance(x.value, torch.Tensor)}
    layout = packing.ShardLayout.of(tensors)
    header = packing.header_bytes(layout, objects, {"step": 1})
    buf = torch.empty(packing.packed_size(layout, header), dtype=torch.uint8)
    packing.pack_into(buf, layout, header, [x.value for x in tensors])
    return buf


def _model(dims: tuple[str]) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=dims)
    for m in (model[0], model[1], model):
        fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_fsdp_state_round_trips_into_a_fresh_model_in_place(group: None) -> None:
    model, opt = _model(("dp",))
    buf = _pack({"model": model, "optim": opt})
    header = packing.parse(buf)
    # The sharding travels as plain JSON data (no pickle) beside each DTensor's local shard.
    meta = header.sharding["model/0.weight"]
    assert meta == {
        "mesh": [1],
        "mesh_dims": ["dp"],
        "placements": ["Shard(dim=0)"],
        "global_shape": [8, 4],
        "coordinate": [0],
    }
    json.dumps(header.sharding)
    fresh, fresh_opt = _model(("dp",))
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    live = fresh.state_dict()["0.weight"]
    assert isinstance(live, DTensor)
    unpacking.unpack_into(buf, {"model": fresh, "optim": fresh_opt})
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
    osd, fresh_osd = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert torch.equal(osd[0]["exp_avg"].full_tensor(), fresh_osd[0]["exp_avg"].full_tensor())


def test_another_mesh_or_placement_is_refused_naming_both(group: None) -> None:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    saved = {"w": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])}
    buf = _pack(saved)
    live = {"w": distribute_tensor(torch.zeros(4), mesh, [Replicate()])}
    with pytest.raises(ShardingMismatchError) as err:
        unpacking.unpack_into(buf, live)
    text = str(err.value)
    assert "w (saved mesh [1] (tp), placements ['Shard(dim=0)']" in text
    assert "live mesh [1] (tp), placements ['Replicate()']" in text
    assert err.value.keys == ["w"]
    assert torch.equal(live["w"].to_local(), torch.zeros(4))  # nothing written
    plain = {"w": torch.zeros(4)}
    with pytest.raises(ShardingMismatchError, match="live a plain tensor"):
        unpacking.unpack_into(buf, plain)
