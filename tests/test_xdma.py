"""The xdma transport against an emulation of the XDMA character devices.

The driver tests of ``test_driver.py`` run here unchanged, with every device they build
served through ``xdma://<mountpoint>/xdma0`` (tests/xdma_emulator.py: FUSE files with the
XDMA driver's read/write/offset/event semantics, the functional model behind them), so
the code path under test is the one a card uses. Then the transport's own failure modes:
missing device files, permission denied, short reads, hung DMA and interrupt timeouts.
"""

from __future__ import annotations

import inspect
import os
import time

import pytest

import test_driver
from dfvg_hw.spec.regmap import Control, Irq, Reg
from dfvg_host.driver import DraftDevice
from dfvg_host.transport import TransportError, open_transport
from dfvg_host.xdma import DEVICE_SUFFIXES, XdmaError, XdmaTransport
from sim.device import SimDevice
from xdma_emulator import XdmaEmulator, fuse_unavailable


class Emulators:
    """Starts emulations for a test and tears them down, transports first.

    Members
    -------
    running : list of XdmaEmulator
    transports : list of XdmaTransport
    """

    def __init__(self):
        self.running: list[XdmaEmulator] = []
        self.transports: list[XdmaTransport] = []

    def serve(self, device: SimDevice, **faults) -> XdmaEmulator:
        emulator = XdmaEmulator(device, device.config.mem_bytes, **faults).start()
        self.running.append(emulator)
        return emulator

    def open(self, device: SimDevice, **faults) -> XdmaTransport:
        """The transport a card would give, by URL, for ``device`` behind emulated files."""
        emulator = self.serve(device, **faults)
        transport, config = open_transport("xdma://" + emulator.prefix)
        assert isinstance(transport, XdmaTransport) and config is None
        self.transports.append(transport)
        return transport

    def close(self) -> None:
        # Close the files while they are still served, then unblock what still waits.
        for transport in self.transports:
            transport.close()
        for emulator in self.running:
            emulator.stop()
        errors = [e.error for e in self.running if e.error is not None]
        assert not errors, f"the XDMA emulation failed: {errors!r}"


@pytest.fixture
def emulators():
    reason = fuse_unavailable()
    if reason and os.environ.get("CI"):
        # CI must run the driver's tests over XDMA: a silent skip would hide them
        pytest.fail(f"the XDMA device emulation needs FUSE, and CI must run it: {reason}")
    if reason:
        pytest.skip(f"the XDMA device emulation needs FUSE: {reason}")
    running = Emulators()
    yield running
    running.close()


# -- the sim device's driver tests, over the xdma transport ---------------------------

#: Every test of test_driver.py that drives a device (the remaining one checks URLs).
DRIVER_TESTS = [
    "test_driver_results_equal_the_functional_model",
    "test_more_layers_than_kv_heads_fill_the_kv_slots",
    "test_rollback_is_bounded",
    "test_error_status_raises_with_the_drafted_tokens",
    "test_context_limit_is_checked_before_the_device",
    "test_stale_result_buffer_is_detected",
    "test_corrupted_result_is_detected",
    "test_timeout",
    "test_engine_checks",
    "test_start_without_program_is_a_device_fault",
    "test_interleaved_sequences_draft_as_each_alone",
    "test_select_sequence_checks_its_index",
    "test_reset_forgets_every_sequence",
    "test_submit_then_collect_equals_draft",
    "test_poll_says_when_a_request_has_finished",
    "test_collect_raises_what_draft_raises",
    "test_one_request_in_flight",
]


def test_every_device_test_of_the_driver_runs_over_xdma():
    defined = {name for name in dir(test_driver) if name.startswith("test_")}
    assert defined - set(DRIVER_TESTS) == {"test_bad_device_urls"}


@pytest.mark.parametrize("name", DRIVER_TESTS)
def test_driver_over_xdma(name, emulators, monkeypatch, request):
    class DraftDeviceOverXdma(DraftDevice):
        """Serves the device a test builds (or opens by sim:// URL) through XDMA files."""

        def __init__(self, transport, compiled, **kwargs):
            if isinstance(transport, SimDevice):
                transport = emulators.open(transport)
            super().__init__(transport, compiled, **kwargs)

    monkeypatch.setattr(test_driver, "DraftDevice", DraftDeviceOverXdma)
    test = getattr(test_driver, name)
    test(**{arg: request.getfixturevalue(arg) for arg in inspect.signature(test).parameters})
    assert emulators.transports, "the test never opened the xdma transport"


# -- the transport's own failure modes ------------------------------------------------

def test_missing_device_files_are_listed(tmp_path):
    prefix = str(tmp_path / "xdma0")
    with pytest.raises(XdmaError, match="load the XDMA driver") as info:
        open_transport("xdma://" + prefix)
    for suffix in DEVICE_SUFFIXES.values():
        assert prefix + suffix in str(info.value)
    (tmp_path / "xdma0_user").write_bytes(bytes(4096))
    with pytest.raises(TransportError, match="files missing: [^ ]*_h2c_0, [^ ]*_c2h_0, [^ ]*_events_0;"):
        XdmaTransport(prefix)


def test_permission_denied_says_what_to_do(emulators, tiny_engine):
    # The emulator refuses the open itself (EACCES), which also stops root, as a device
    # node's mode bits would for a user.
    emulator = emulators.serve(SimDevice(tiny_engine), deny={"xdma0_user"})
    with pytest.raises(XdmaError, match=r"permission denied opening .*xdma0_user; run as root"):
        XdmaTransport(emulator.prefix)


def test_partial_dma_reads_are_completed(emulators, tiny_engine):
    device = SimDevice(tiny_engine)
    transport = emulators.open(device, c2h_chunk=64)
    payload = bytes(range(256)) * 5
    transport.dma_write(0x4000, payload)
    assert transport.dma_read(0x4000, len(payload)) == payload == device.dma_read(0x4000, len(payload))


def test_short_dma_read_is_an_error(emulators, tiny_engine):
    transport = emulators.open(SimDevice(tiny_engine), c2h_stop_after=100)
    with pytest.raises(XdmaError, match=r"short read from .*xdma0_c2h_0: 100 of 608 bytes from card "
                                        r"address 0x120000"):
        transport.dma_read(0x120000, 608)


def test_hung_dma_times_out_and_blocks_further_dma(emulators, tiny_engine):
    transport = emulators.open(SimDevice(tiny_engine), c2h_stall=True)
    transport.dma_timeout_s = 0.3
    started = time.monotonic()
    with pytest.raises(XdmaError, match="did not finish within 0.3 s; the card or the XDMA driver is hung"):
        transport.dma_read(0, 16)
    assert time.monotonic() - started < 2
    with pytest.raises(XdmaError, match="refused, an earlier DMA never finished"):
        transport.dma_write(0, b"x")


def test_interrupt_wait_times_out_and_events_are_consumed(emulators, tiny_engine):
    transport = emulators.open(SimDevice(tiny_engine))
    started = time.monotonic()
    assert transport.wait_irq(0.15) is False
    assert 0.1 < time.monotonic() - started < 1.5
    # START without a program finishes at once with an error: the interrupt fires.
    transport.write32(Reg.IRQ_ENABLE, Irq.DONE)
    transport.write32(Reg.CONTROL, Control.START)
    assert transport.wait_irq(5.0) is True
    assert transport.wait_irq(0.05) is False        # the event was consumed
    # An event nobody waited for is dropped when the driver clears IRQ_STATUS.
    transport.write32(Reg.CONTROL, Control.START)
    transport.write32(Reg.IRQ_STATUS, Irq.DONE)
    assert transport.wait_irq(0.05) is False


def test_registers_through_the_bar_file(emulators, tiny_engine):
    device = SimDevice(tiny_engine)
    transport = emulators.open(device)
    assert not transport.mapped          # the emulated files refuse mmap: pread/pwrite path
    assert transport.read32(Reg.ID) == device.read32(Reg.ID)
    assert transport.read32(0x008) == 0xDEADBEEF           # unmapped offset
    transport.write32(Reg.PROG_LEN, 0x1_0000_0007)          # masked to 32 bits
    assert device.read32(Reg.PROG_LEN) == 7
    with pytest.raises(ValueError, match="not a 32-bit register"):
        transport.read32(Reg.PROG_LEN + 2)


def test_mapped_register_access_is_one_word(tmp_path):
    """The mmap path on plain files: each access moves exactly one aligned 32-bit word."""
    prefix = tmp_path / "xdma0"
    for suffix in DEVICE_SUFFIXES.values():
        (tmp_path / f"xdma0{suffix}").write_bytes(bytes(4096))
    transport = XdmaTransport(str(prefix))
    try:
        assert transport.mapped
        transport.write32(0x40, 0x12345678)
        assert transport.read32(0x40) == 0x12345678
        transport._map.flush()
        raw = (tmp_path / "xdma0_user").read_bytes()
        assert raw[0x40:0x44] == bytes([0x78, 0x56, 0x34, 0x12]) and raw.count(0) == 4092
    finally:
        transport.close()
