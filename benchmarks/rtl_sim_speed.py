"""Simulator speed and cycle counts of the RTL engine, on one request, in one run.

Runs the same request (the embed / up / down / logits / sample forward of
``dfvg_host.fixtures``, which ``tests/test_rtl_device.py`` runs too, drafting greedily) on
the ``tiny`` engine in Amaranth's simulator (``rtl``) and in Verilator (``rtl+verilator``),
and on the functional model (``sim``). Prints, for each RTL simulator, the engine's own
cycle count for the request (its CYCLES counter, measured in simulation), the wall time of
the request and the simulated cycles per second; and the cycle model's estimate of the
same request next to the RTL's count.

    python benchmarks/rtl_sim_speed.py [--draft 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dfvg_hw.spec.descriptors import DraftRequest, DraftResult, result_bytes  # noqa: E402
from dfvg_hw.spec.isa import assemble, to_bytes  # noqa: E402
from dfvg_hw.spec.regmap import Control, Irq, MemoryMap, Reg  # noqa: E402
from dfvg_host.fixtures import TINY, TINY_FORWARD as FORWARD, tiny_image as image  # noqa: E402
from sim.device import SimDevice  # noqa: E402
from sim.rtl_device import RtlDevice  # noqa: E402
from sim.verilator_device import VerilatorDevice  # noqa: E402


def timed_request(device, request: DraftRequest) -> tuple[DraftResult, float]:
    """Load the program, run ``request``; return the result and the request's wall time."""
    w = device.write32
    device.dma_write(MemoryMap.IMAGE, image())
    words = assemble(FORWARD)
    device.dma_write(MemoryMap.PROGRAM, to_bytes(words))
    for reg, value in ((Reg.IMAGE_BASE_LO, MemoryMap.IMAGE), (Reg.IRQ_ENABLE, Irq.DONE),
                       (Reg.PROG_BASE_LO, MemoryMap.PROGRAM), (Reg.PROG_LEN, len(words)),
                       (Reg.CONTROL, Control.LOAD_PROGRAM), (Reg.REQ0_LO, MemoryMap.REQUEST[0]),
                       (Reg.RES0_LO, MemoryMap.RESULT[0])):
        w(reg, value)
    device.dma_write(MemoryMap.REQUEST[0], request.pack())
    start = time.perf_counter()
    w(Reg.CONTROL, Control.START)
    if not device.wait_irq(3600.0):
        raise RuntimeError("no completion interrupt")
    wall = time.perf_counter() - start
    raw = device.dma_read(MemoryMap.RESULT[0], result_bytes(TINY.topk_max, request.n_draft))
    return DraftResult.unpack(raw, TINY.topk_max), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", type=int, default=8, help="tokens to draft")
    args = ap.parse_args()
    request = DraftRequest([3, 7], start_pos=0, n_draft=args.draft, topk=4, seq=1)
    reference, _ = timed_request(SimDevice(TINY), request)
    print(f"request: 2 input tokens, {args.draft} drafted greedily, tiny engine "
          f"({TINY.clock_mhz:g} MHz nominal)")
    print(f"{'simulator':<16}{'engine cycles':>14}{'wall s':>10}{'cycles/s':>12}  tokens == sim")
    speeds = {}
    for name, make in (("rtl (Amaranth)", RtlDevice), ("rtl+verilator", VerilatorDevice)):
        device = make(TINY)
        result, wall = timed_request(device, request)
        device.close()
        speeds[name] = result.cycles / wall
        print(f"{name:<16}{result.cycles:>14,}{wall:>10.2f}{speeds[name]:>12,.0f}  "
              f"{[t.token for t in result.tokens] == [t.token for t in reference.tokens]}")
    ratio = speeds["rtl+verilator"] / speeds["rtl (Amaranth)"]
    print(f"Verilator / Amaranth simulator speed: {ratio:,.0f}x (measured)")
    print(f"cycle model: {reference.cycles:,} cycles [modelled]; RTL: {result.cycles:,} cycles "
          f"[measured in simulation]; RTL / model = {result.cycles / reference.cycles:.3f}")


if __name__ == "__main__":
    main()
