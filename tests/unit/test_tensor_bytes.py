"""Tensor archives framed from templates are exactly torch.save's (CRC32 off) and load back."""

from __future__ import annotations

import io

import pytest
import torch

from restartable.checkpoint.persistent.tensor_bytes import ArchiveTemplates, raw_bytes


def _reference(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


FRAMED = {
    "float32": torch.arange(1000, dtype=torch.float32),
    "bfloat16_2d": torch.rand(3, 4).to(torch.bfloat16),
    "int64_scalar": torch.tensor(5),
    "int8_tiny": torch.tensor([1, 2, 3], dtype=torch.int8),
    "large_4mib": torch.rand(1 << 20),
    "bool": torch.tensor([True, False, True]),
}


@pytest.mark.parametrize("name", list(FRAMED))
def test_framed_archive_is_byte_identical_to_torch_save(name: str) -> None:
    t = FRAMED[name]
    templates = ArchiveTemplates()
    assert templates.frame(t) is not None
    out = io.BytesIO()
    templates.write(t, out)
    expected = _crc_off_reference(t)
    assert out.getvalue() == expected
    torch.testing.assert_close(torch.load(io.BytesIO(out.getvalue())), t)


def _crc_off_reference(t: torch.Tensor) -> bytes:
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        return _reference(t)
    finally:
        torch.serialization.set_crc32_options(before)


def test_template_is_reused_for_new_data_of_the_same_shape() -> None:
    templates = ArchiveTemplates()
    a, b = torch.rand(64, 64), torch.rand(64, 64)
    assert templates.frame(a) is templates.frame(b)
    out = io.BytesIO()
    templates.write(b, out)
    torch.testing.assert_close(torch.load(io.BytesIO(out.getvalue())), b)
    assert out.getvalue() == _crc_off_reference(b)


FALLBACK = {
    "empty": torch.zeros(0),
    "transposed": torch.rand(4, 4).t(),
    "narrowed_view": torch.rand(100)[10:20],
    "requires_grad": torch.rand(3, requires_grad=True),
    "parameter": torch.nn.Parameter(torch.rand(3)),
}


@pytest.mark.parametrize("name", list(FALLBACK))
def test_what_a_template_cannot_express_goes_through_torch_save(name: str) -> None:
    t = FALLBACK[name]
    templates = ArchiveTemplates()
    assert templates.frame(t) is None
    out = io.BytesIO()
    templates.write(t, out)
    assert out.getvalue() == _reference(t)
    loaded = torch.load(io.BytesIO(out.getvalue()), weights_only=False)
    torch.testing.assert_close(loaded.detach(), t.detach())


def test_raw_bytes_is_a_zero_copy_view_of_any_dtype() -> None:
    t = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    view = raw_bytes(t)
    assert bytes(view) == bytes(t.view(torch.uint8).tolist())
    t[0] = 3.0
    assert bytes(view) == bytes(t.view(torch.uint8).tolist())
