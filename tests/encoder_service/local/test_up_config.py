"""`epd up`'s configuration (up_config.py): defaults, clear errors, the transport `auto`
stands for. What a deployment plans from it: test_up.py."""

from __future__ import annotations

import json

import pytest

from encoder_service.local import up_config
from encoder_service.local.up_config import UpConfig, UpError, load_up_config


def test_defaults_and_clear_errors(tmp_path):
    cfg = load_up_config(None)
    assert (cfg.encoders, cfg.decoders, cfg.base_port, cfg.transport) == (1, 1, 18100,
                                                                          "auto")
    bad = tmp_path / "up.json"
    bad.write_text(json.dumps({"encoder": 2}))
    with pytest.raises(UpError, match="encoder: Extra inputs.*Known keys: .*encoders"):
        load_up_config(bad)
    with pytest.raises(UpError, match="config file .*missing.toml does not exist"):
        load_up_config(tmp_path / "missing.toml")
    (tmp_path / "broken.toml").write_text("encoders = [")
    with pytest.raises(UpError, match="cannot parse config file .*broken.toml as TOML"):
        load_up_config(tmp_path / "broken.toml")
    bad.write_text(json.dumps({"decoders": 0}))
    with pytest.raises(UpError, match="decoders"):
        load_up_config(bad)
    toml = tmp_path / "up.toml"
    toml.write_text('encoders = 2\n[gateway.limits]\nmax_media_items = 4\n')
    cfg = load_up_config(toml)
    assert cfg.encoders == 2 and cfg.gateway == {"limits": {"max_media_items": 4}}


def test_auto_picks_shared_memory_on_one_host_and_says_why(monkeypatch):
    cfg = UpConfig(encoders=2, base_port=18630)
    assert cfg.transport_choice == ("shm", "every server runs on this host "
                                    '(transport = "safetensors" opts out)')
    assert cfg.tiers == ["shm"] and cfg.shm_path.endswith("/up-18630")
    # no room for the arenas (a container's 64 MiB /dev/shm): the shared directory, and why
    monkeypatch.setattr(up_config, "shm_unusable", lambda need: f"{need >> 20} MiB do not fit")
    assert UpConfig(encoders=2).transport_choice == ("safetensors", "1024 MiB do not fit")
    assert UpConfig(transport="shm").transport_choice == ("shm", "as configured")


@pytest.mark.parametrize("args, want", [
    ([], None),
    (["--limit-mm-per-prompt", '{"image": 1, "video": 1}'], 1),
    (['--limit-mm-per-prompt={"image": 3}'], 3),
    (["--limit-mm-per-prompt", '{"image": {"count": 2, "width": 512}}'], 2),
    (["--limit-mm-per-prompt", '{"video": 1}'], None),
    (["--limit-mm-per-prompt", "not json"], None),
    (["--max-model-len", "2048"], None),
])
def test_the_gateway_never_shares_more_images_per_call_than_vllm_takes(args, want):
    from encoder_service.local.up_config import gateway_routing, images_per_prompt

    assert images_per_prompt(args) == want
    routing = gateway_routing({"overlap": "off"}, args)
    assert routing.get("coalesce_items") == (None if want is None else min(want, 8))
    assert routing["overlap"] == "off"
    # a value the user set stays
    assert gateway_routing({"coalesce_items": 5}, args) == {"coalesce_items": 5}
