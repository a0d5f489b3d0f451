"""A direct session on the functional model: place an image and program, run requests.

This is the functional model's own test harness (no registers, no transport): it puts
the image, program and descriptors at fixed device addresses and calls the engine. The
host driver reaches the same engine through the register map instead.
"""

from __future__ import annotations

from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.spec.descriptors import DraftRequest, DraftResult, request_bytes, result_bytes
from dfvg_hw.spec.isa import to_bytes
from sim.functional import FunctionalEngine

__all__ = ["FunctionalSession"]

PROGRAM_ADDR = 0x0000_0000
REQUEST_ADDR = 0x0004_0000
RESULT_ADDR = 0x0008_0000
IMAGE_ADDR = 0x0010_0000


class FunctionalSession:
    """An engine with one image and program loaded.

    Members
    -------
    engine : FunctionalEngine
    """

    def __init__(self, config: EngineConfig, image: bytes, program: list[int]):
        self.engine = FunctionalEngine(config)
        mem = self.engine.memory
        mem.write(IMAGE_ADDR, image)
        mem.write(PROGRAM_ADDR, to_bytes(program))
        self.engine.load_program(PROGRAM_ADDR, len(program))
        self._seq = 0

    def run(self, request: DraftRequest) -> DraftResult:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        request.seq = self._seq
        mem = self.engine.memory
        mem.write(REQUEST_ADDR, request.pack())
        self.engine.run(image_base=IMAGE_ADDR, request_addr=REQUEST_ADDR, result_addr=RESULT_ADDR)
        topk_max = self.engine.config.topk_max
        return DraftResult.unpack(mem.read(RESULT_ADDR, result_bytes(topk_max, request.n_records)), topk_max)
