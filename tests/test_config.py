import pytest

from dfvg_hw.spec.config import PRESETS, ConfigError, EngineConfig, get_preset


def test_presets_are_valid_and_documented():
    assert {"tiny", "alveo-u55c", "alveo-u280", "alveo-u250"} <= set(PRESETS)
    for cfg in PRESETS.values():
        cfg.validate()
        assert cfg.source, f"{cfg.name} must say where its numbers come from"


def test_board_presets_are_memory_bound_for_chains():
    # A chain (one row) streams lanes*reduce weight bytes per cycle at II=1; the tile must
    # be at least as wide as the memory can feed, or compute would be the bottleneck.
    for name in ("alveo-u55c", "alveo-u280", "alveo-u250"):
        cfg = get_preset(name)
        assert cfg.lanes * cfg.reduce >= cfg.mem_bytes_per_cycle


def test_kv_capacity_is_counted_in_slots():
    """A slot is one (layer, KV head) pair: the presets keep the capacity they had as
    layers × heads (u55c: 12 × 12 = 144 slots, the 18.9 MB its source names)."""
    slots = {"tiny": 4, "alveo-u55c": 144, "alveo-u280": 144, "alveo-u250": 144,
             "nitefury": 24, "litefury": 4}
    assert {name: get_preset(name).kv_slots for name in slots} == slots
    assert get_preset("alveo-u55c").kv_bytes == 2 * 144 * 1024 * 64 * 12 // 8     # 12-bit elements


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ConfigError, match="known presets: tiny, alveo-u55c"):
        get_preset("alveo-v80")


@pytest.mark.parametrize("change, param", [
    (dict(lanes=48), "lanes"),
    (dict(reduce=2), "reduce"),
    (dict(head_dim=24), "head_dim"),
    (dict(topk_max=600), "topk_max"),
    (dict(acc_bits=24), "acc_bits"),
    (dict(vmem_bytes=100), "vmem_bytes"),
    (dict(rows=0), "rows"),
    (dict(clock_mhz=0), "clock_mhz"),
    (dict(kv_slots=0), "kv_slots"),
    (dict(kv_slots=1 << 16), "kv_slots"),
    (dict(draft_cores=0), "draft_cores"),
    (dict(draft_cores=17), "draft_cores"),
    (dict(draft_cores=2.0), "draft_cores"),
    (dict(draft_cores=True), "draft_cores"),
])
def test_invalid_combinations_name_the_parameter(change, param):
    with pytest.raises(ConfigError, match=f"{param} = "):
        get_preset("tiny").with_changes(**change)


def test_draft_cores_default_to_one_and_round_trip():
    """Every preset is one core; a config with several round-trips through its dict (the
    compiled draft's manifest holds ``to_dict()``)."""
    assert {cfg.draft_cores for cfg in PRESETS.values()} == {1}
    two = get_preset("tiny").with_changes(draft_cores=2)
    assert two.to_dict()["draft_cores"] == 2
    assert EngineConfig(**two.to_dict()) == two
    assert EngineConfig(**get_preset("alveo-u55c").to_dict()) == get_preset("alveo-u55c")
