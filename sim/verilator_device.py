"""The ``rtl+verilator`` device: the generated engine's Verilog compiled by Verilator, behind
the transport operations — the same design as the ``rtl`` device, simulated ~100× faster.

The engine's Verilog (``dfvg_hw.engine.DraftEngine``) and ``sim/verilator/harness.cpp`` are
built once per engine configuration into ``~/.cache/dfvg/verilator/<hash>/`` (Debian's
``verilator`` package; the README's test setup installs it). The harness process models
device memory as a file both it and this process map, with the preset's latency and
bandwidth (the timing of ``sim/axi_memory.py``), and takes register accesses and
"run until the interrupt" commands on a pipe.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from dfvg_hw.spec.config import EngineConfig
from dfvg_hw.engine import DraftEngine
from sim.axi_memory import MemoryTiming
from sim.memory import MemoryError_
from dfvg_hw.verilog import to_verilog

__all__ = ["VerilatorDevice", "build_harness"]

HARNESS = Path(__file__).parent / "verilator" / "harness.cpp"
TOP = "dfvg_engine"
#: cycles simulated per "run" command before the wall clock is checked again
RUN_CHUNK = 200_000


def _cache_dir() -> Path:
    return Path(os.environ.get("DFVG_CACHE", Path.home() / ".cache" / "dfvg")) / "verilator"


def _build_key(config: EngineConfig, data_width: int | None, verilator_version: str) -> str:
    """16 hex digits over what the harness binary depends on: the generator's sources
    (the Verilog is a function of them, the configuration and Amaranth), the harness and
    the Verilator version. Hashing the sources, not the generated Verilog, spares every
    device the 15–25 s of elaborating the engine once the binary is built."""
    import amaranth

    import dfvg_hw
    h = hashlib.sha256()
    for source in sorted(Path(dfvg_hw.__file__).parent.rglob("*.py")):
        h.update(source.read_bytes())
    h.update(repr((sorted(config.to_dict().items()), data_width, amaranth.__version__,
                   verilator_version)).encode())
    h.update(HARNESS.read_bytes())
    return h.hexdigest()[:16]


def build_harness(config: EngineConfig, data_width: int | None = None, log=None) -> Path:
    """The harness binary for ``config`` (built unless the cache has it)."""
    exe = shutil.which("verilator")
    if exe is None:
        raise FileNotFoundError("verilator is not installed (Debian package 'verilator'; the "
                                "README's test setup installs it)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    out = _cache_dir() / _build_key(config, data_width, version)
    binary = out / "obj_dir" / "harness"
    out.mkdir(parents=True, exist_ok=True)
    # Processes building one key (pytest-xdist workers) take turns: the later ones wait
    # for the first to link the binary, then find it.
    with open(out / "build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if binary.exists():
            return binary
        (out / f"{TOP}.v").write_text(to_verilog(DraftEngine(config, data_width), TOP))
        if log:
            log(f"verilator: building the {config.name} engine (about a minute, once)")
        # -Wno-fatal: lint is the RTL tests' job (verilator --lint-only); here only speed matters.
        proc = subprocess.run([exe, "--cc", "--exe", "--build", "-O2", "-Wno-fatal", "-Wno-lint",
                               "-Wno-style", "--top-module", TOP, "-o", "harness", f"{TOP}.v",
                               str(HARNESS), "-CFLAGS", "-O1 -std=c++17"],
                              cwd=out, capture_output=True, text=True)
        if proc.returncode or not binary.exists():
            raise RuntimeError(f"verilator build failed:\n{(proc.stderr or proc.stdout)[-3000:]}")
    return binary


class VerilatorDevice:
    """The engine in Verilator, offering the transport operations.

    Members
    -------
    config : EngineConfig
    cycles : int
        Clock cycles simulated so far.
    sim_seconds : float
        Wall time spent in the simulator.
    """

    def __init__(self, config: EngineConfig, *, data_width: int | None = None,
                 timing: MemoryTiming | None = None, log=None):
        self.config = config
        binary = build_harness(config, data_width, log)
        timing = timing or MemoryTiming.for_config(config, data_width)
        self._dir = tempfile.TemporaryDirectory(prefix="dfvg-verilator-")
        path = Path(self._dir.name) / "device-memory"
        with open(path, "wb") as f:
            f.truncate(config.mem_bytes)                  # sparse: costs what is written
        self._file = open(path, "r+b")
        self._memory = mmap.mmap(self._file.fileno(), config.mem_bytes)
        self._proc = subprocess.Popen(
            [str(binary), str(path), str(config.mem_bytes), str(timing.read_latency),
             str(timing.write_latency), str(round(timing.beats_per_cycle * 1e6))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.cycles = 0
        self.sim_seconds = 0.0

    def _command(self, line: str) -> str:
        start = time.monotonic()
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()
        answer = self._proc.stdout.readline()
        self.sim_seconds += time.monotonic() - start
        if not answer:
            raise RuntimeError(f"the Verilator harness exited (code {self._proc.poll()})")
        return answer.strip()

    def _check(self, addr: int, n: int) -> None:
        if addr < 0 or n < 0 or addr + n > self.config.mem_bytes:
            raise MemoryError_(f"device-memory access [0x{addr:x}, 0x{addr + n:x}) outside "
                               f"the {self.config.mem_bytes}-byte memory")

    # -- transport operations ---------------------------------------------------------------
    def read32(self, offset: int) -> int:
        return int(self._command(f"r {offset}"))

    def write32(self, offset: int, value: int) -> None:
        self._command(f"w {offset} {value & 0xFFFFFFFF}")

    def dma_write(self, addr: int, data: bytes) -> None:
        data = bytes(data)
        self._check(addr, len(data))
        self._memory[addr:addr + len(data)] = data

    def dma_read(self, addr: int, nbytes: int) -> bytes:
        self._check(addr, nbytes)
        return self._memory[addr:addr + nbytes]

    def run_cycles(self, cycles: int) -> bool:
        """Advance the clock by ``cycles``, or until the interrupt; whether it is up."""
        irq, ran = (int(x) for x in self._command(f"run {cycles}").split())
        self.cycles += ran
        return bool(irq)

    def wait_irq(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.run_cycles(RUN_CHUNK):
                return True
            if time.monotonic() >= deadline:
                return False

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._command("quit")
            except (BrokenPipeError, RuntimeError):
                pass
            self._proc.wait(timeout=10)
        self._memory.close()
        self._file.close()
        self._dir.cleanup()

    def __del__(self):
        if getattr(self, "_proc", None) is not None and self._proc.poll() is None:
            self._proc.kill()

    @property
    def cycles_per_second(self) -> float:
        return self.cycles / self.sim_seconds if self.sim_seconds else 0.0
