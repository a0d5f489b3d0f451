"""The logical-to-physical map of a multi-channel engine (dfvg_hw.spec.striping)."""

import numpy as np
import pytest

from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.striping import Striping


def test_one_port_is_the_identity():
    s = Striping.for_config(get_preset("tiny"))
    for a in (0, 1, 15, 4096, (1 << 24) - 1):
        assert s.physical(a) == a == s.logical(a)
    assert s.pieces(100, 7) == [(0, 100, 0)]


def test_engine_beats_lie_across_the_channels():
    s = Striping.for_config(get_preset("tiny-hbm"))
    assert (s.ports, s.port_bytes, s.beat_bytes, s.channel_bytes) == (4, 16, 64, 1 << 22)
    # beat 1, port 2, byte 3
    assert s.physical(64 + 32 + 3) == 2 * (1 << 22) + 16 + 3
    rng = np.random.default_rng(0)
    for a in rng.integers(0, s.size, 2000):
        a = int(a)
        assert s.logical(s.physical(a)) == a
        assert s.port_of(s.physical(a)) == (a % 64) // 16


def test_channel_runs_round_trip_and_are_contiguous():
    s = Striping.for_config(get_preset("tiny-hbm"))
    data = np.arange(64 * 5, dtype=np.uint32).astype(np.uint8)
    runs = s.to_channels(128, data)
    assert [(p, phys) for p, phys, _ in runs] == [(p, p * (1 << 22) + 32) for p in range(4)]
    for p, phys, run in runs:
        assert run.size == 5 * 16
        for i in range(run.size):
            assert s.logical(phys + i) - 128 == int(np.flatnonzero(data == run[i])[0]) or \
                data[s.logical(phys + i) - 128] == run[i]
    assert np.array_equal(s.from_channels(128, [r for _, _, r in runs]), data)


def test_pieces_cover_a_range_once_in_order():
    s = Striping.for_config(get_preset("tiny-hbm"))
    pieces = s.pieces(40, 100)
    covered = []
    for i, (port, phys, off) in enumerate(pieces):
        end = pieces[i + 1][2] if i + 1 < len(pieces) else 100
        covered += [s.logical(phys + j) - 40 for j in range(end - off)]
        assert s.port_of(phys) == port
    assert covered == list(range(100))


def test_partial_beats_are_refused():
    s = Striping.for_config(get_preset("tiny-hbm"))
    with pytest.raises(ValueError, match="whole 64-byte engine beats"):
        s.to_channels(16, bytes(64))
    with pytest.raises(ValueError, match="outside"):
        s.to_channels(s.size, bytes(64))


def _fake_card(striping):
    """A card's physical memory and its DMA calls, for StripedDma."""
    phys = np.zeros(striping.size, np.uint8)
    calls = []

    def write(addr, data):
        calls.append(("w", addr, len(data)))
        phys[addr:addr + len(data)] = np.frombuffer(data, np.uint8)

    def read(addr, n):
        calls.append(("r", addr, n))
        return phys[addr:addr + n].tobytes()
    return phys, calls, write, read


@pytest.mark.parametrize("addr, nbytes", [(0, 64 * 8), (40, 300), (64, 10), (5, 3), (128, 64), (0, 1)])
def test_striped_dma_puts_every_byte_where_the_engine_reads_it(addr, nbytes):
    from dfvg_host.xdma import StripedDma

    s = Striping(4, 16, 1 << 12)
    phys, calls, write, read = _fake_card(s)
    data = np.random.default_rng(addr).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    dma = StripedDma(s, write, read)
    dma.write(addr, data)
    for i, byte in enumerate(data):
        assert phys[s.physical(addr + i)] == byte
    # whole beats go as one DMA per channel, not a DMA per port beat
    whole = max(0, (addr + nbytes) // 64 - -(-addr // 64))
    assert len(calls) <= 4 * (whole > 0) + 2 * 4
    assert dma.read(addr, nbytes) == data


def test_one_channel_dma_is_a_single_transfer():
    from dfvg_host.xdma import StripedDma

    s = Striping(1, 16, 1 << 12)
    phys, calls, write, read = _fake_card(s)
    StripedDma(s, write, read).write(5, b"abc")
    assert calls == [("w", 5, 3)] and phys[5:8].tobytes() == b"abc"
