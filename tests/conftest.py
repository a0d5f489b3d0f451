"""Shared fixtures: tiny Llama drafts built in seconds, compiled by the real compiler; the
``rtl`` and ``slow`` markers.

torch is imported only by the fixtures and tests that need it, so the RTL tests
(``pytest tests/rtl``, ``pytest -m rtl``) run where torch is not installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dfvg_hw.spec.config import get_preset
# make_tiny_llama lives in the package so that the benchmarks share it; test modules
# import it from here as before.
from dfvg_host.fixtures import make_tiny_llama

__all__ = ["make_tiny_llama"]

TESTS = Path(__file__).resolve().parent

#: Tests that run the Amaranth simulator or Verilator, besides everything under tests/rtl/:
#: whole modules by file name, single tests by "file::name".
RTL_MODULES = {"test_rtl_device.py", "test_rtl_driver.py"}
RTL_TESTS = {"test_vivado_flow.py::test_engine_ports_lint_and_match_the_block_design"}

#: Tests that take more than about 20 s on one core of the CI machine (measured with
#: ``pytest --durations``): "file::name" marks every parametrisation of the test,
#: "file::name[id]" one of them.
SLOW_TESTS: set[str] = set()


def _one_torch_thread() -> None:
    # The test models are tiny: one thread beats two threads spinning on the 2-core CI
    # machine (and two xdist workers share it). Applied once torch has been imported by
    # whoever needed it; never imports it.
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def _torch():
    import torch
    _one_torch_thread()
    return torch


@pytest.fixture(scope="session")
def tiny_engine():
    return get_preset("tiny")


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    _torch()
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_gqa_dir(tmp_path_factory) -> Path:
    _torch()
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-gqa"), hidden=64, heads=4, kv_heads=2,
                           intermediate=96, tie=True, seed=1)


@pytest.fixture(scope="session")
def tiny_compiled(tiny_draft_dir, tiny_engine):
    from dfvg_host.compiler import compile_draft
    _torch()
    return compile_draft(tiny_draft_dir, tiny_engine)


@pytest.fixture(scope="session")
def demo_pair():
    """(draft dir, target dir, data dir) of the shipped demo pair."""
    from dfvg_host.demo import DEMO_DATA, demo_paths
    draft, target = demo_paths()
    return draft, target, DEMO_DATA


@pytest.fixture(scope="session")
def demo_compiled(demo_pair):
    """The demo draft compiled for alveo-u55c by the real compiler."""
    from dfvg_host.compiler import compile_draft
    _torch()
    draft, _, data = demo_pair
    return compile_draft(draft, get_preset("alveo-u55c"),
                         calibration_text=(data / "calibration.txt").read_text())


def pytest_addoption(parser):
    parser.addoption("--vcd", metavar="DIR", help="write a VCD waveform of every RTL simulation into DIR")


def pytest_configure(config):
    import os
    if config.getoption("--vcd"):
        os.environ["DFVG_VCD"] = config.getoption("--vcd")


def pytest_collection_modifyitems(config, items):
    """Mark ``rtl`` every test under tests/rtl/ and every test in RTL_MODULES / RTL_TESTS,
    and ``slow`` the tests of SLOW_TESTS."""
    for item in items:
        path = Path(item.path).resolve()
        name = path.name
        base = f"{name}::{getattr(item, 'originalname', item.name)}"
        if TESTS / "rtl" in path.parents or name in RTL_MODULES or base in RTL_TESTS:
            item.add_marker(pytest.mark.rtl)
        if base in SLOW_TESTS or f"{name}::{item.name}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session):
    _one_torch_thread()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _one_torch_thread()
