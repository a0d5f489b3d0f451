"""The functional model's MATMUL ``BIAS`` and ``BLOCKS`` flags, MATMUL ``INT32`` mode and
RMSNORM segments (docs/isa.md §3.3, §3.4), each held against numpy written from the ISA
text rather than from the model's own helpers."""

from __future__ import annotations

import numpy as np
import pytest

from dfvg_hw.spec import numerics as nx
from dfvg_hw.spec.config import VMEM_LINE_BYTES, get_preset
from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.image import (matmul_bytes, pack_norm_params, pack_requant_records, padded,
                                tile_weights, weight_area_bytes)
from dfvg_hw.spec.isa import Flag, Instruction, MatmulMode, Op
from sim.functional import FunctionalEngine
from sim.memory import DeviceMemory
from sim.op_bench import functional_reference

CFG = get_preset("tiny")
L = VMEM_LINE_BYTES


def _engine(block: bytes) -> FunctionalEngine:
    memory = DeviceMemory(CFG.mem_bytes)
    memory.write(0, block)
    return FunctionalEngine(CFG, memory)


def _round_shift(v: int, s: int) -> int:
    return (v + (1 << s >> 1)) >> s


def _sat(v: int, bits: int) -> int:
    return max(-(1 << bits - 1), min((1 << bits - 1) - 1, v))


def _matmul_case(rng, n, k, bias):
    w = rng.integers(-127, 128, (n, k), dtype=np.int64)
    mult = rng.integers(1, 1 << 16, n)
    shift = rng.integers(8, 40, n)
    b = rng.integers(-(1 << 31), 1 << 31, n) if bias else None
    block = (tile_weights(w.astype(np.int8), CFG.lanes, CFG.reduce).tobytes()
             + pack_requant_records(mult, shift, b, padded(n, CFG.lanes), CFG.lanes))
    assert len(block) <= matmul_bytes(n, k, CFG.lanes, CFG.reduce, bias)
    return w, mult, shift, b, block


@pytest.mark.parametrize("mode", [MatmulMode.INT8, MatmulMode.RESADD, MatmulMode.INT32])
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_bias_and_int32_mode(mode, bias):
    rng = np.random.default_rng(int(mode) * 2 + bias)
    n, k = 20, 24                          # several lane groups, a padded reduction
    w, mult, shift, b, block = _matmul_case(rng, n, k, bias)
    engine = _engine(block)
    x = rng.integers(-32768, 32768, k)
    engine.vmem[0:2 * k] = x.astype("<i2").view(np.uint8)
    dst_line = 8
    res = rng.integers(-(1 << 31), 1 << 31, n)
    engine.vmem[dst_line * L: dst_line * L + 4 * n] = res.astype("<i4").view(np.uint8)
    flags = Flag.WIDE | mode << 1 | (Flag.BIAS if bias else 0)
    ins = Instruction(Op.MATMUL, flags=flags, rows=1, dst=dst_line, src=0, n=n, k=k, addr=0)
    assert functional_reference(engine, ins) == ErrorCode.OK
    for i in range(n):
        acc = int(sum(int(x[j]) * int(w[i, j]) for j in range(k))) + (int(b[i]) if bias else 0)
        y = _round_shift(acc * int(mult[i]), int(shift[i]))
        if mode == MatmulMode.INT8:
            got = int(engine.vmem[dst_line * L + i].view(np.int8))
            assert got == _sat(y, 8)
        else:
            got = int(engine.vmem[dst_line * L + 4 * i: dst_line * L + 4 * i + 4].view("<i4")[0])
            want = _sat(int(res[i]) + _sat(y, 32), 32) if mode == MatmulMode.RESADD else _sat(y, 32)
            assert got == want


@pytest.mark.parametrize("mode", list(MatmulMode))
@pytest.mark.parametrize("wide", [False, True])
def test_matmul_blocks(mode, wide):
    """A BLOCKS matmul (bias on) in every mode, int8 and int16 rows: each output from the
    ISA text: per k-tile dot products times their multipliers, rounded once by 2^16, plus
    the bias, requantised; the block's records follow its scale tiles."""
    rng = np.random.default_rng(30 + int(mode) * 2 + wide)
    n, k, reduce = 20, 44, CFG.reduce                 # several groups and runs, a padded tile
    w = rng.integers(-128, 128, (n, k))
    m = rng.integers(0, 1 << 16, (n, -(-k // reduce)))
    m[m % 5 == 0], m[m % 5 == 1] = 0, (1 << 16) - 1
    mult, shift = rng.integers(1, 1 << 16, n), rng.integers(8, 40, n)
    b = rng.integers(-(1 << 31), 1 << 31, n)
    block = (tile_weights(w.astype(np.int8), CFG.lanes, reduce, m).tobytes()
             + pack_requant_records(mult, shift, b, padded(n, CFG.lanes), CFG.lanes))
    assert len(block) <= matmul_bytes(n, k, CFG.lanes, reduce, True, True)
    assert weight_area_bytes(n, k, CFG.lanes, reduce, True) == padded(n, 4) * (48 + 16)
    engine = _engine(block)
    x = rng.integers(-32768, 32768, k) if wide else rng.integers(-128, 128, k)
    engine.vmem[0:k * (1 + wide)] = x.astype("<i2" if wide else np.int8).view(np.uint8)
    dst_line = 8
    res = rng.integers(-(1 << 31), 1 << 31, n)
    engine.vmem[dst_line * L: dst_line * L + 4 * n] = res.astype("<i4").view(np.uint8)
    flags = (Flag.WIDE if wide else 0) | mode << 1 | Flag.BIAS | Flag.BLOCKS
    ins = Instruction(Op.MATMUL, flags=flags, rows=1, dst=dst_line, src=0, n=n, k=k, addr=0)
    assert functional_reference(engine, ins) == ErrorCode.OK
    for i in range(n):
        total = sum(int(m[i, j // reduce]) * int(x[j]) * int(w[i, j]) for j in range(k))
        y = _round_shift((_round_shift(total, 16) + int(b[i])) * int(mult[i]), int(shift[i]))
        if mode == MatmulMode.INT8:
            assert int(engine.vmem[dst_line * L + i].view(np.int8)) == _sat(y, 8)
        elif mode == MatmulMode.LOGITS:
            assert int(engine.logits[i]) == _sat(y, 16)
        else:
            got = int(engine.vmem[dst_line * L + 4 * i: dst_line * L + 4 * i + 4].view("<i4")[0])
            want = _sat(int(res[i]) + _sat(y, 32), 32) if mode == MatmulMode.RESADD else _sat(y, 32)
            assert got == want


def test_bias_records_past_memory_fault_bad_address():
    rng = np.random.default_rng(5)
    n, k = 16, 16
    *_, block = _matmul_case(rng, n, k, True)
    engine = _engine(block)
    # the block ends exactly at the end of memory without a bias; with one it needs 8n more
    start = CFG.mem_bytes - (matmul_bytes(n, k, CFG.lanes, CFG.reduce) - 0)
    flags = MatmulMode.INT8 << 1 | Flag.BIAS
    ins = Instruction(Op.MATMUL, flags=flags, rows=1, dst=8, src=0, n=n, k=k, addr=start)
    assert functional_reference(engine, ins) == ErrorCode.BAD_ADDRESS
    ins = Instruction(Op.MATMUL, flags=MatmulMode.INT8 << 1, rows=1, dst=8, src=0, n=n, k=k, addr=start)
    assert functional_reference(engine, ins) == ErrorCode.OK


@pytest.mark.parametrize("wide", [False, True])
def test_rmsnorm_segments_normalise_each_head_alone(wide):
    rng = np.random.default_rng(7 + wide)
    n, segments = 16, 3
    gamma = rng.integers(-32768, 32768, n)
    eps, gamma_shift = 12345, 3
    engine = _engine(pack_norm_params(eps, gamma, gamma_shift))
    # heads of very different magnitudes: one row shift for all would flatten the small ones
    x = np.concatenate([rng.integers(-(1 << e), 1 << e, n) for e in (30, 9, 20)])
    engine.vmem[0:4 * n * segments] = x.astype("<i4").view(np.uint8)
    dst = 16
    flags = Flag.WIDE if wide else 0
    ins = Instruction(Op.RMSNORM, flags=flags, rows=1, dst=dst, src=0, n=n, k=segments, addr=0)
    assert functional_reference(engine, ins) == ErrorCode.OK
    bits = 16 if wide else 8
    got = engine.vmem[dst * L: dst * L + n * segments * bits // 8].view("<i2" if wide else np.int8)
    for s in range(segments):
        want = nx.rmsnorm(x[s * n:(s + 1) * n], gamma, gamma_shift, eps, bits)
        np.testing.assert_array_equal(got[s * n:(s + 1) * n], want)
    # ... which is what one RMSNORM per head computes
    whole = nx.rmsnorm(x, np.tile(gamma, segments), gamma_shift, eps, bits)
    assert not np.array_equal(got, whole)


def test_rmsnorm_segments_off_the_line_fault_program():
    engine = _engine(pack_norm_params(1, np.ones(12, np.int64), 0))
    ins = Instruction(Op.RMSNORM, rows=1, dst=16, src=0, n=12, k=2, addr=0)
    assert functional_reference(engine, ins) == ErrorCode.PROGRAM
    ins = Instruction(Op.RMSNORM, rows=1, dst=16, src=0, n=12, k=1, addr=0)
    assert functional_reference(engine, ins) == ErrorCode.OK


def test_embed_position_indexes_the_table_by_pos():
    """OPT's learned position embeddings: EMBED POSITION reads row POS, not row TOKEN."""
    from dfvg_hw.spec.image import embed_row_stride
    rng = np.random.default_rng(9)
    n = 8
    stride = embed_row_stride(n, CFG.mem_beat_bytes)
    table = rng.integers(-(1 << 31), 1 << 31, (CFG.kv_positions, stride // 4)).astype("<i4")
    engine = _engine(table.tobytes())
    for pos in (0, 5, CFG.kv_positions - 1):
        ins = Instruction(Op.EMBED, flags=Flag.POSITION, rows=1, dst=4, n=n, addr=0)
        assert functional_reference(engine, ins, pos=pos) == ErrorCode.OK
        got = engine.vmem[4 * L: 4 * L + 4 * n].view("<i4")
        np.testing.assert_array_equal(got, table[pos, :n])
    ins = Instruction(Op.EMBED, flags=Flag.POSITION, rows=1, dst=4, n=n, addr=0)
    assert functional_reference(engine, ins, pos=CFG.kv_positions) == ErrorCode.KV_OVERFLOW


@pytest.mark.parametrize("wide", [False, True])
def test_ungated_actmul_reads_the_gate_alone(wide):
    """An ungated MLP (OPT's ReLU): h = requant(lut[g], mult, shift); the bytes after the
    gate are not read."""
    from dfvg_hw.spec.image import pack_act_params
    rng = np.random.default_rng(11 + wide)
    n = 32
    lut = rng.integers(-32768, 32768, 256)
    mult, shift = 40000, 18
    engine = _engine(pack_act_params(mult, shift, lut))
    gate = rng.integers(-128, 128, n)
    engine.vmem[0:n] = gate.astype(np.int8).view(np.uint8)
    engine.vmem[n:2 * n] = 0                        # an up row would zero every output
    flags = Flag.UNGATED | (Flag.WIDE if wide else 0)
    ins = Instruction(Op.ACTMUL, flags=flags, rows=1, dst=8, src=0, n=n, addr=0)
    assert functional_reference(engine, ins) == ErrorCode.OK
    bits = 16 if wide else 8
    got = engine.vmem[8 * L: 8 * L + n * bits // 8].view("<i2" if wide else np.int8)
    want = [_sat(_round_shift(int(lut[g + 128]) * mult, shift), bits) for g in gate]
    np.testing.assert_array_equal(got, want)
    assert np.any(got)
