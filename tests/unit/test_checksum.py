"""The local tier's shard checksum: sees corruption, streams, fits an int64 header field."""

from __future__ import annotations

import torch

from restartable.checkpoint.local import integrity


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_one_flipped_bit_changes_it() -> None:
    buf = _bytes(1 << 20)
    before = integrity.of(buf, buf.numel())
    for pos in (0, 4097, buf.numel() - 1):
        buf[pos] ^= 1
        assert integrity.of(buf, buf.numel()) != before
        buf[pos] ^= 1
    assert integrity.of(buf, buf.numel()) == before


def test_covers_only_the_first_nbytes() -> None:
    buf = _bytes(1000)
    before = integrity.of(buf, 600)
    buf[700] ^= 0xFF
    assert integrity.of(buf, 600) == before
    assert integrity.of(buf, 601) != before


def test_parts_fed_in_order_equal_the_whole() -> None:
    """The transport checksums chunk by chunk as they arrive; the saver checksums the whole."""
    buf = _bytes(3 * 4096 + 17)
    c = integrity.Checksum()
    for a in range(0, buf.numel(), 4096):
        c.update(buf[a : a + 4096])
    assert c.value == integrity.of(buf, buf.numel())


def test_value_fits_an_int64_tensor() -> None:
    """It travels in the transport's int64 header and must come back unchanged."""
    values = [integrity.of(_bytes(64, seed), 64) for seed in range(64)]
    assert any(v < 0 for v in values)  # the top bit is set about half the time
    t = torch.tensor(values, dtype=torch.int64)
    assert [int(x) for x in t.tolist()] == values
