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
    {"te_data_path": "pigeon"},
])
def test_bad_values_are_rejected(extra):
    with pytest.raises(ConfigError) as exc:
        EPDConfig.from_dict(extra)
    assert next(iter(extra)) in str(exc.value)


def test_te_data_path_resolves_by_protocol_and_pool():
    def socket(**extra) -> bool:
        return EPDConfig.from_dict({"transport": "mooncake", **extra}).te_socket

    assert socket() and socket(protocol="tcp", te_data_path="socket")
    assert not socket(protocol="rdma") and not socket(te_data_path="engine")
    assert socket(protocol="rdma", te_data_path="socket")
    assert not socket(memory_pool_device="cuda")  # auto: the engine for a device pool
    with pytest.raises(ConfigError, match="te_data_path 'socket' receives into host memory"):
        EPDConfig.from_dict({"te_data_path": "socket", "memory_pool_device": "cuda"})


# -- the groups ------------------------------------------------------------------------------
def test_groups_combine_into_one_flat_frozen_strict_config():
    from ec_connectors import config as c

    groups = [c.CommonSettings, c.SafetensorsSettings, c.MooncakeSettings, c.StoreSettings,
              c.ShmSettings, c.ProducerSettings, c.ConsumerSettings, c.GuardSettings]
    owned = [k for g in groups for k in g.model_fields]
    assert len(owned) == len(set(owned))  # every key in one group only
    assert list(EPDConfig.model_fields) == [*owned, "control_dir"]  # group order, flat
    assert all(g.__doc__ for g in groups)
    cfg = EPDConfig.from_dict({"transport": ["mooncake", "safetensors"], "lease_ttl_s": 5,
                               "store_retries": 1, "load_threads": 3})
    assert cfg.tiers == ["mooncake", "safetensors"] and cfg.lease_ttl_s == 5
    assert (cfg.store_retries, cfg.load_threads) == (1, 3)
    with pytest.raises(ValueError, match="frozen"):
        cfg.load_threads = 4
    with pytest.raises(ConfigError, match="transport: Value error, transport tiers"):
        EPDConfig.from_dict({"transport": ["mooncake", "mooncake"]})


# -- config files and error messages -------------------------------------------------------
def test_read_config_file_json_or_toml_with_errors_naming_the_file(tmp_path):
    from epd_common.config_files import InvalidConfig, read_config_file

    (tmp_path / "a.json").write_text('{"x": 1, "y": {"z": [1, 2]}}')
    (tmp_path / "a.toml").write_text('x = 1\n[y]\nz = [1, 2]\n')
    assert read_config_file(tmp_path / "a.json") == read_config_file(str(tmp_path / "a.toml"))
    with pytest.raises(InvalidConfig, match=r"config file .*nope\.json does not exist"):
        read_config_file(tmp_path / "nope.json")
    (tmp_path / "bad.toml").write_text("x = [")
    with pytest.raises(InvalidConfig, match=r"cannot parse config file .*bad\.toml as TOML"):
        read_config_file(tmp_path / "bad.toml")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ConfigError, match=r"list\.json must hold an object of keys, not a list"):
        read_config_file(tmp_path / "list.json", error=ConfigError)
    with pytest.raises(InvalidConfig, match="cannot read config file"):
        read_config_file(tmp_path)  # a directory


def test_explain_is_one_line_per_config():
    from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

    from epd_common.config_files import InvalidConfig, explain, model_keys

    class Inner(BaseModel):
        model_config = ConfigDict(extra="forbid")
        b: int = 0

    class Outer(BaseModel):
        model_config = ConfigDict(extra="forbid")
        a: int = 0
        inner: Inner = Inner()

        @model_validator(mode="after")
        def _check(self):
            if self.a == 7:
                raise ValueError("a must not be 7")
            return self

    assert model_keys(Outer) == ["a", "inner.b"]
    with pytest.raises(ValidationError) as exc:
        Outer.model_validate({"a": "x", "inner": {"c": 1}})
    assert explain(exc.value, "invalid thing", model_keys(Outer)) == (
        "invalid thing: a: Input should be a valid integer, unable to parse string as an "
        "integer; inner.c: Extra inputs are not permitted. Known keys: a, inner.b")
    with pytest.raises(ValidationError) as exc:
        Outer.model_validate({"a": 7})
    assert explain(exc.value, "invalid thing") == (
        "invalid thing: <root>: Value error, a must not be 7")
    assert issubclass(ConfigError, InvalidConfig) and issubclass(ConfigError, ValueError)


# -- transport names: one list ---------------------------------------------------------------
def test_transport_names_are_one_list():
    import inspect
    import typing

    from ec_connectors.protocol.stored import TIERED, TRANSPORT_NAMES
    from ec_connectors.transports import _make_one
    from encoder_service.gateway.config import AvailabilityConfig

    for name in TRANSPORT_NAMES:
        assert EPDConfig.from_dict({"transport": name}).tiers == [name]
        assert f'name == "{name}"' in inspect.getsource(_make_one)  # a branch for each
    assert EPDConfig.from_dict({"transport": list(TIERED)}).tiers == list(TIERED)
    # shm: one host only; nixl: mooncake's alternative on the same ports (one or the other)
    assert sorted(TIERED) == sorted(set(TRANSPORT_NAMES) - {"shm", "nixl"})
    kinds = typing.get_args(AvailabilityConfig.model_fields["kind"].annotation)
    assert set(kinds) - {"none"} <= set(TRANSPORT_NAMES)
    with pytest.raises(ValueError, match="unknown transport 'pigeon' .known: safetensors"):
        _make_one("pigeon", EPDConfig(), None)
