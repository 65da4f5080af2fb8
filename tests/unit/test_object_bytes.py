"""ObjectArchives reuses a value's torch.save archive only for an exactly equal value."""

from __future__ import annotations

import io
from typing import Any

import torch

from restartable.checkpoint.persistent.object_bytes import ObjectArchives


def _load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def test_an_exactly_equal_value_reuses_the_archive_of_the_last_save() -> None:
    objects = ObjectArchives()
    first = objects.archive(["a", "b", 0.5])
    objects.end_save()
    assert objects.archive(["a", "b", 0.5]) is first
    assert _load(first) == ["a", "b", 0.5]


def test_values_equal_to_python_but_saved_differently_get_their_own_archive() -> None:
    pairs = [(0.0, -0.0), (1, True), (1, 1.0), ((1, 2), [1, 2]), ("x", b"x")]
    for a, b in pairs:
        objects = ObjectArchives()
        objects.archive(a)
        objects.end_save()
        got = _load(objects.archive(b))
        assert type(got) is type(b) and repr(got) == repr(b), (a, b)
    objects = ObjectArchives()
    nan = objects.archive(float("nan"))
    objects.end_save()
    assert objects.archive(float("nan")) is nan  # the same bits: reused


def test_unvouched_values_are_archived_afresh_and_unused_archives_forgotten() -> None:
    objects = ObjectArchives()
    d = {"k": 1}
    first = objects.archive(d)
    objects.end_save()
    d["k"] = 2
    assert _load(objects.archive(d)) == {"k": 2}  # a dict: never reused
    assert first is not objects.archive(d)
    kept = objects.archive(7)
    objects.end_save()  # this save used 7
    objects.end_save()  # the next one did not
    assert objects.archive(7) is not kept
