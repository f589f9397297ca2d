import pytest

from ec_connectors.config import ConfigError, EPDConfig


def test_defaults_are_valid():
    cfg = EPDConfig.from_dict(None)
    assert cfg.transport == "safetensors"
    assert cfg.on_unavailable == "local_encode"
    assert cfg.load_timeout_s > 0


def test_unknown_key_is_a_clear_error():
    with pytest.raises(ConfigError) as exc:
        EPDConfig.from_dict({"storage_pth": "/x"})
    msg = str(exc.value)
    assert "storage_pth" in msg and "storage_path" in msg  # names the typo and the known keys


@pytest.mark.parametrize("extra", [
    {"transport": "carrier-pigeon"},
    {"max_storage_bytes": 0},
    {"load_timeout_s": -1},
    {"on_unavailable": "pray"},
    {"max_pending_saves": "many"},
])
def test_bad_values_are_rejected(extra):
    with pytest.raises(ConfigError) as exc:
        EPDConfig.from_dict(extra)
    assert next(iter(extra)) in str(exc.value)
