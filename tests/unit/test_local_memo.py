"""The local tier's walk memo: leaves of unchanged tensor mappings reused, every change seen."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from restartable.checkpoint.local import walk
from restartable.checkpoint.local.leaf import Leaf, ReplicatedState
from restartable.checkpoint.local.memo import Block, WalkMemo, expand


def _state() -> dict[str, Any]:
    model = {f"layer{i}.weight": torch.full((2, 3), float(i)) for i in range(10)}
    optim = {f"layer{i}.weight": {"step": torch.tensor(1.0), "m": torch.zeros(2, 3)}
             for i in range(10)}  # fmt: skip
    return {"model": model, "optim": {"state": optim, "lr": 0.1}, "step": 7}


def _view(leaves: list[Leaf]) -> list[tuple[Any, ...]]:
    """What a save reads of each leaf: key, value (by identity), sharding."""
    return [
        (x.key, id(x.value) if isinstance(x.value, torch.Tensor) else x.value, x.replicated,
         x.sharding)
        for x in leaves
    ]  # fmt: skip


def _walks(state: dict[str, Any], memo: WalkMemo) -> list[Leaf]:
    """A save's walk with the memo, checked against a walk without it."""
    got = expand(walk.save_parts(state, [], memo))
    assert _view(got) == _view(walk.leaves(state, []))
    return got


def _deep(state: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state one level deeper (per parameter group), for changes three levels
    down."""
    state["optim"]["state"] = {"group0": state["optim"]["state"]}
    return state


@pytest.mark.parametrize("deep", [False, True], ids=["two levels", "three levels"])
def test_unchanged_mappings_come_from_the_memo_with_the_same_leaves(deep: bool) -> None:
    state, memo = _deep(_state()) if deep else _state(), WalkMemo()
    _walks(state, memo)
    seen: list[tuple[str, bool | None]] = []
    replay = memo.replay

    def recorded(obj: Any, prefix: str, rep: bool, out: list[Leaf | Block]) -> bool | None:
        seen.append((prefix, replay(obj, prefix, rep, out)))
        return seen[-1][1]

    memo.replay = recorded  # type: ignore[method-assign]
    _walks(state, memo)
    hits = {prefix for prefix, hit in seen if hit}
    # The model's 10 tensors and the optimizer state's 10 x 2 come from the memo; the mapping
    # with a scalar in it is walked.
    assert hits == {"model", "optim/state"}, seen


@pytest.mark.parametrize(
    "change",
    [
        "replace a tensor",
        "add a key",
        "remove a key",
        "replace a nested mapping",
        "scalar",
        "a nested tensor becomes a mapping",
        "a nested mapping becomes a tensor",
        "a nested mapping changes type",
        "the same keys in another order",
        "three levels down: replace a tensor",
        "three levels down: add a key",
    ],
)
def test_every_change_of_a_remembered_mapping_is_seen(change: str) -> None:
    deep = change.startswith("three levels down")
    state, memo = _deep(_state()) if deep else _state(), WalkMemo()
    _walks(state, memo)
    _walks(state, memo)
    per_param = state["optim"]["state"]["group0"] if deep else state["optim"]["state"]
    if change == "replace a tensor":
        state["model"]["layer3.weight"] = torch.ones(4)
    elif change == "add a key":
        per_param["layer3.weight"]["v"] = torch.ones(2, 3)
    elif change == "remove a key":
        del state["model"]["layer0.weight"]
    elif change == "replace a nested mapping":
        per_param["layer5.weight"] = {"step": torch.tensor(2.0)}
    elif change == "scalar":
        state["model"]["layer3.weight"] = 3.5  # a tensor became a scalar
    elif change == "a nested tensor becomes a mapping":
        per_param["layer2.weight"]["m"] = {"x": torch.zeros(1)}
    elif change == "a nested mapping becomes a tensor":
        per_param["layer2.weight"] = torch.zeros(1)
    elif change == "a nested mapping changes type":
        per_param["layer4.weight"] = ReplicatedState(per_param["layer4.weight"])
    elif change == "the same keys in another order":
        per_param["layer1.weight"] = dict(reversed(per_param["layer1.weight"].items()))
    elif change == "three levels down: replace a tensor":
        per_param["layer7.weight"]["m"] = torch.ones(2, 3)
    else:
        per_param["layer8.weight"]["v"] = torch.ones(3)
    got = _walks(state, memo)  # the same leaves as a walk without the memo
    _walks(state, memo)  # and again, from the memo rebuilt after the change
    assert len(got) == len(walk.leaves(state, []))


def test_a_new_mapping_around_remembered_ones_is_walked_and_they_are_replayed() -> None:
    """A state_dict() that builds its outer dict anew at every call, around the same model and
    optimizer mappings: the outer is walked, the inner come from the memo, and the leaves are
    those of a walk without it."""
    inner = _state()
    memo = WalkMemo()
    # Every outer dict stays alive: a new one at a freed one's address would be replayed whole.
    outers = [{"train": {"model": inner["model"], "state": inner["optim"]["state"]}}]
    _walks(outers[0], memo)
    for _ in range(3):
        fresh = {"train": {"model": inner["model"], "state": inner["optim"]["state"]}}
        outers.append(fresh)
        parts = walk.save_parts(fresh, [], memo)
        blocks = [p for p in parts if isinstance(p, Block)]
        assert [len(b.values) for b in blocks] == [10, 20]
        assert _view(expand(parts)) == _view(walk.leaves(fresh, []))


def test_the_memo_keeps_no_tensor_alive() -> None:
    state, memo = _state(), WalkMemo()
    _walks(state, memo)
    _walks(state, memo)
    ref = weakref.ref(state["model"]["layer1.weight"])
    del state
    gc.collect()
    assert ref() is None  # the memo holds weak references only


def test_dtensor_leaves_reuse_their_shard_only_while_the_dtensor_holds_it(group: None) -> None:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    params = {f"w{i}": distribute_tensor(torch.full((4, 2), float(i)), mesh, [Shard(0)])
              for i in range(3)}  # fmt: skip
    state, memo = {"model": params}, WalkMemo()
    first = _walks(state, memo)
    assert all(x.sharding is not None for x in first)
    second = _walks(state, memo)
    assert all(a.value is b.value for a, b in zip(first, second, strict=True))
    # The DTensor gets another local tensor (what FSDP's internals or `.data =` could do): the
    # memo must not hand out the old one.
    with torch.no_grad():
        params["w1"]._local_tensor = torch.zeros(4, 2)
    third = _walks(state, memo)
    assert third[1].value is params["w1"]._local_tensor
