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
RTL_MODULES = {"test_rtl_device.py", "test_rtl_driver.py", "test_rtl_tree.py"}
RTL_TESTS = {"test_vivado_flow.py::test_engine_ports_lint_and_match_the_block_design",
             "test_multi_draft.py::test_two_rtl_cores_of_one_card_draft_for_two_drafters"}

#: Tests that take more than about 20 s (``pytest --durations``, one process on the 2-core
#: machine under load): "file::name" marks every parametrisation of the test,
#: "file::name[id]" one of them. ``pytest -m "not slow"`` is the quick loop.
SLOW_TESTS = {
    # block-scaled MATMULs at wide geometries, and the block-scaled demo draft's accuracy
    "test_matmul_sequencer.py::test_blocks_32_lanes_wide_bus",
    "test_matmul_sequencer.py::test_blocks_reduce_32",
    "test_matmul_sequencer.py::test_block_timing_corners[rows8]",
    "test_compiler_accuracy.py::test_block_scaled_weights_agree_at_least_as_well",
    # whole engines drafting trees: the Amaranth-simulated engine, and tiny-hbm's build
    "test_rtl_tree.py::test_a_tree_on_the_amaranth_engine",
    "test_rtl_tree.py::test_tree_sessions_at_tiny_hbm",
    "test_matmul_sequencer.py::test_32_lanes_wide_bus",
    "test_matmul_sequencer.py::test_16_lanes",
    "test_matmul_sequencer.py::test_tiny_random_jobs",
    "test_matmul_sequencer.py::test_reduce_32_eight_rows",
    "test_matmul_sequencer.py::test_timing_corners[rows8]",
    "test_matmul_sequencer.py::test_slow_memory",
    "test_token_sampler.py::test_random_vectors[4-4-1000]",
    "test_token_sampler.py::test_random_vectors[8-1-200]",
    "test_kv_sequencer.py::test_lint_clean",
    "test_kv_sequencer.py::test_one_word_entries_and_a_wide_bus",
    "test_kv_sequencer.py::test_full_context_and_overflow",
    "test_kv_sequencer.py::test_appends_then_attention_gqa_wide_and_narrow",
    "test_rope_sequencer.py::test_heads_rows_in_place_and_table_offsets",
    "test_rope_sequencer.py::test_lint_clean",
    "test_fuzz_rtl.py::test_random_cases",
    # builds the tiny-hbm engine in Verilator (shared with the multi-channel driver tests)
    "test_fuzz_rtl.py::test_regressions_and_a_sample_at_tiny_hbm",
    # builds a Verilator engine of its own (tiny-hbm with 32-byte VMEM lines, issue #14)
    "test_fuzz_rtl.py::test_a_sample_at_a_wider_vmem_line",
    # every case builds the engine's Verilog (and, once, the Verilator harness)
    "test_rtl_device.py::test_rtl_device_matches_the_sim_device",
    "test_cli.py::test_generate_json_on_the_demo_pair",
    "test_cli.py::test_generate_streams_text_and_labels_figures",
    "test_compiler_accuracy.py::test_int8_engine_agrees_with_float_draft",
    # SmolLM2-135M imported from its GGUF (~20 s), compiled (~30 s), 256 positions (~50 s)
    "test_real_checkpoint.py::test_smollm2_135m_follows_its_float_model_at_the_default_preset",
    # Not reached by the measuring run; slow by what they do (a compiled draft on the RTL
    # engine; 24 prompts x 128 tokens; 3 000 samples).
    "test_rtl_driver.py::test_driver_on_the_rtl_engine_equals_the_sim_device",
    "test_rtl_driver.py::test_generate_runs_end_to_end_on_verilator",
    "test_rtl_driver.py::test_multichannel_engine_equals_the_sim_device",
    "test_speculative.py::test_greedy_is_exact_on_the_demo_pair",
    "test_speculative.py::test_sampling_is_lossless",
    # ~60 s and ~40 s: 10 prompts x 64 tokens three ways; 1 500 samples
    "test_pipelined.py::test_greedy_is_exact_on_the_demo_pair",
    "test_pipelined.py::test_sampling_is_lossless",
    "test_tensor_parallel_serve.py::test_two_ranks_serve_greedy_as_the_target_alone",
    # a subprocess generating on the demo pair, as the two generate tests above
    "test_cli.py::test_generate_adaptive_gamma_json",
    # ~30 s: 1 500 adaptive generations for the chi-square
    "test_adaptive.py::test_sampling_is_lossless[self-1500]",
    # several drafters: 2 x 8 prompts x 64 tokens on the demo pair; 1 000 samples each
    "test_multi_draft.py::test_greedy_is_exact_with_the_two_demo_drafters",
    "test_multi_draft.py::test_sampling_is_lossless",
    "test_multi_draft.py::test_two_rtl_cores_of_one_card_draft_for_two_drafters",
    "test_draft_cores.py::test_two_cores_draft_alone_and_at_once",
    # ~20-30 s: 1 000 tree generations for the chi-square
    "test_tree_drafting.py::test_sampling_is_lossless",
    # ~40 s: 1 200 pipelined tree generations for the chi-square
    "test_pipelined_tree.py::test_sampling_is_lossless",
}


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
    """The tiny draft compiled with h's row exponents (ACTMUL/MATMUL ROWEXP, off by
    default), so that every engine test of it runs them too."""
    from dfvg_host.compiler import compile_draft
    _torch()
    return compile_draft(tiny_draft_dir, tiny_engine, row_exponents=True)


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
