"""ResultWriter against ``DraftResult.pack`` (docs/isa.md §5.2): records and header in
device memory exactly as the functional model writes them, check word included."""

from __future__ import annotations

from amaranth import Module
from amaranth.lib import wiring
from amaranth.lib.wiring import Out

from dfvg_hw.memory_port import MemoryPort
from dfvg_hw.result_writer import ResultWriter
from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.descriptors import DraftedToken, DraftResult, ErrorCode, result_bytes
from dfvg_hw.verilog import to_verilog
from sim.axi_memory import AXI4SlaveMemory, MemoryTiming
from sim.lint import verilator_lint
from sim.memory import DeviceMemory
from sim.testbench import run_simulation, stream_put

TINY = get_preset("tiny")
BASE = 0x3000


class _Bench(wiring.Component):
    def __init__(self, config, data_width):
        self.writer = ResultWriter(config, data_width)
        self.port = MemoryPort(config, data_width=data_width)
        super().__init__({"axi": Out(self.port.axi.signature)})

    def elaborate(self, platform):
        m = Module()
        writer = m.submodules.writer = self.writer
        port = m.submodules.port = self.port
        wiring.connect(m, writer.write_cmd, port.write_cmd)
        wiring.connect(m, writer.write_data, port.write_data)
        wiring.connect(m, port.axi, wiring.flipped(self.axi))
        m.d.comb += writer.write_idle.eq(port.write_idle)
        return m


def _write(result: DraftResult, data_width: int = 128) -> bytes:
    memory = DeviceMemory(TINY.mem_bytes)
    bench = _Bench(TINY, data_width)
    w = bench.writer
    slave = AXI4SlaveMemory(bench.axi, memory, MemoryTiming.for_config(TINY, data_width))

    async def tb(ctx):
        ctx.set(w.clear, 1)
        await ctx.tick()
        ctx.set(w.clear, 0)
        for token in result.tokens:
            words = token.record(TINY.topk_max)
            for i, word in enumerate(words):
                assert ctx.get(w.word) == i
                await stream_put(ctx, w.record, {"word": word, "k": len(token.topk_ids),
                                                 "last": i == len(words) - 1})
        for name, value in dict(seq=result.seq, status=int(result.status), end_pos=result.end_pos,
                                cycles=result.cycles, n_forward=result.n_forward,
                                error_pc=result.error_pc, base=BASE).items():
            ctx.set(getattr(w, name), value)
        ctx.set(w.start, 1)
        await ctx.tick()
        ctx.set(w.start, 0)
        for _ in range(2000):
            if ctx.get(w.done):
                return
            await ctx.tick()
        raise AssertionError("the result writer did not finish")

    run_simulation(bench, tb, processes=[slave.process])
    return memory.read(BASE, result_bytes(TINY.topk_max, len(result.tokens)))


def _tokens(n):
    return [DraftedToken(10 + i, 1000 * i + 7, [10 + i, 3][:1 + i % 2], [1000 * i + 7, 5][:1 + i % 2])
            for i in range(n)]


def test_results_as_the_functional_model_packs_them():
    for result, width in [
        (DraftResult(seq=9, status=ErrorCode.OK, end_pos=12, cycles=(3 << 32) + 77,
                     n_forward=4, tokens=_tokens(3), topk=1), 128),
        (DraftResult(seq=2, status=ErrorCode.KV_OVERFLOW, end_pos=5, cycles=999, n_forward=1,
                     error_pc=6, tokens=_tokens(2), topk=1), 256),
        (DraftResult(seq=1, status=ErrorCode.BAD_REQUEST, end_pos=0, cycles=40, n_forward=0), 128),
    ]:
        assert _write(result, width) == result.pack(TINY.topk_max)


def test_lint():
    ok, log = verilator_lint(to_verilog(ResultWriter(TINY, 128), "result_writer"), "result_writer")
    assert ok, log
