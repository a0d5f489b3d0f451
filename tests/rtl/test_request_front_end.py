"""RequestFrontEnd against the functional model's request checks (docs/isa.md §5.1,
``FunctionalEngine._read_request_tokens``): the same outcome for good and bad headers,
bad tokens and requests outside device memory, and the header as ``DraftRequest`` packs it."""

from __future__ import annotations

from amaranth import Module
from amaranth.lib import wiring
from amaranth.lib.wiring import Out

from dfvg_hw.memory_port import MemoryPort
from dfvg_hw.request_front_end import RequestFrontEnd
from dfvg_hw.spec.config import get_preset
from dfvg_hw.spec.descriptors import REQUEST_HEADER_WORDS, DraftRequest, ErrorCode
from dfvg_hw.verilog import to_verilog
from sim.axi_memory import AXI4SlaveMemory, MemoryTiming
from sim.functional import EngineFault, FunctionalEngine
from sim.lint import verilator_lint
from sim.memory import DeviceMemory
from sim.testbench import run_simulation, stream_put

TINY = get_preset("tiny")
ADDR = 0x2000


class _Bench(wiring.Component):
    """The front end with a memory port (whose refusals it sees as ``mem_error``)."""

    def __init__(self, config):
        self.front = RequestFrontEnd(config, 128)
        self.port = MemoryPort(config, data_width=128)
        super().__init__(wiring.Signature({
            "start": self.front.signature.members["start"],
            "axi": Out(self.port.axi.signature),
        }))

    def elaborate(self, platform):
        m = Module()
        front = m.submodules.front = self.front
        port = m.submodules.port = self.port
        wiring.connect(m, wiring.flipped(self.start), front.start)
        wiring.connect(m, front.read_cmd, port.read_cmd)
        wiring.connect(m, port.read_data, front.read_data)
        wiring.connect(m, port.axi, wiring.flipped(self.axi))
        m.d.comb += front.mem_error.eq(port.error.as_value().any())
        return m


def _run(raw: bytes, addr: int = ADDR) -> tuple[int, dict]:
    """The front end's outcome and header for request bytes ``raw`` at ``addr``."""
    memory = DeviceMemory(TINY.mem_bytes)
    memory.write(addr, raw[:TINY.mem_bytes - addr])
    bench = _Bench(TINY)
    slave = AXI4SlaveMemory(bench.axi, memory, MemoryTiming.for_config(TINY, 128))
    out = {}

    async def tb(ctx):
        await stream_put(ctx, bench.start, addr)
        for _ in range(500):
            if ctx.get(bench.front.done):
                out["error"] = ctx.get(bench.front.error)
                break
            await ctx.tick()
        await ctx.tick()
        words = ctx.get(bench.front.header.as_value())
        out["header"] = words.to_bytes(4 * REQUEST_HEADER_WORDS, "little")

    run_simulation(bench, tb, processes=[slave.process])
    return out["error"], out["header"]


def _reference(raw: bytes, addr: int = ADDR) -> int:
    memory = DeviceMemory(TINY.mem_bytes)
    memory.write(addr, raw[:TINY.mem_bytes - addr])
    engine = FunctionalEngine(TINY, memory)
    try:
        header = DraftRequest.unpack_header(memory.read(addr, 4 * REQUEST_HEADER_WORDS))
        engine._read_request_tokens(header, addr)
    except EngineFault as fault:
        return int(fault.code)
    except Exception:
        return int(ErrorCode.BAD_ADDRESS)          # the header is not in device memory
    return int(ErrorCode.OK)


def _request(**changes) -> DraftRequest:
    fields = dict(tokens=[3, 7, 11], start_pos=5, n_draft=4, topk=2, sample=True, t_mult=300,
                  t_shift=9, seed=0x1234_5678_9ABC, counter=17, seq=42)
    return DraftRequest(**(fields | changes))


def test_good_request_reads_the_header_as_packed():
    raw = _request().pack()
    error, header = _run(raw)
    assert error == ErrorCode.OK == _reference(raw)
    assert header == raw[:4 * REQUEST_HEADER_WORDS]


def _with_word(raw: bytes, word: int, value: int) -> bytes:
    b = bytearray(raw)
    b[4 * word: 4 * word + 4] = value.to_bytes(4, "little")
    return bytes(b)


def test_bad_headers_and_tokens_are_refused_as_the_functional_model_does():
    good = _request().pack()
    cases = [
        _request(topk=0).pack(), _request(topk=TINY.topk_max + 1).pack(),
        _request(n_draft=65).pack(), _request(t_mult=0).pack(), _request(t_shift=64).pack(),
        _request(tokens=[]).pack(),                                  # n_in = 0
        _request(tokens=[1, TINY.vocab_max, 2]).pack(),              # a token out of range
        _with_word(good, 1, 3),                                      # a reserved flag bit
        _with_word(good, 12, 1),                                     # a reserved word
        _request(t_mult=0, sample=False).pack(),                     # greedy needs no t_mult
    ]
    got = [_run(raw)[0] for raw in cases]
    assert got == [_reference(raw) for raw in cases]
    assert got == [ErrorCode.BAD_REQUEST] * 9 + [ErrorCode.OK]


def test_requests_outside_device_memory():
    raw = _request(tokens=list(range(40))).pack()
    for addr in (TINY.mem_bytes - 32, TINY.mem_bytes - 4 * REQUEST_HEADER_WORDS - 16):
        assert _run(raw, addr)[0] == _reference(raw, addr) == ErrorCode.BAD_ADDRESS


def test_lint():
    ok, log = verilator_lint(to_verilog(RequestFrontEnd(TINY, 128), "request_front_end"),
                             "request_front_end")
    assert ok, log
