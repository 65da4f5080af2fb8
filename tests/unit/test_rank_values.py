"""The plain values a persistent save compares between ranks (checkpoint/rank_values.py)."""

from __future__ import annotations

import torch

from restartable.checkpoint import PerRank
from restartable.checkpoint.rank_values import _fingerprint, plain_values


def test_plain_values_are_the_states_tensors_and_scalars_outside_per_rank() -> None:
    state = {
        "model": torch.nn.Linear(2, 2),  # a module: its own business
        "own": PerRank(rng=torch.get_rng_state()),
        "rng": torch.get_rng_state(),
        "loader": {"pos": 3, "order": [torch.tensor(1.5), "a"]},
        "sparse": torch.eye(2).to_sparse(),
    }
    assert [p for p, _ in plain_values(state)] == [
        "state['loader']['order'][0]",
        "state['loader']['order'][1]",
        "state['loader']['pos']",
        "state['rng']",
    ]


def test_fingerprints_tell_values_of_any_dtype_and_shape_apart() -> None:
    for a, b in [
        (torch.tensor(1.0), torch.tensor(2.0)),  # 0-d
        (torch.zeros(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16)),
        (torch.tensor([True]), torch.tensor([False])),
        (torch.zeros(4), torch.zeros(2, 2)),  # same bytes, another shape
        (3, 4),
    ]:
        assert _fingerprint(a) != _fingerprint(b)
        assert _fingerprint(a) == _fingerprint(a.clone() if isinstance(a, torch.Tensor) else a)
