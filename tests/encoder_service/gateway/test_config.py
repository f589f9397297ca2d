"""The gateway's configuration (config.py): every error names its key."""

from __future__ import annotations

import pytest

from encoder_service.gateway.config import GatewayConfig, GatewayConfigError


def test_config_errors_name_the_key():
    with pytest.raises(GatewayConfigError, match="decoders"):
        GatewayConfig.build({"encoders": []})
    with pytest.raises(GatewayConfigError, match="limits.max_media_byte"):
        GatewayConfig.build({"decoders": ["http://a:1"], "limits": {"max_media_byte": 1}})
    with pytest.raises(GatewayConfigError, match="base URL"):
        GatewayConfig.build({"decoders": ["ftp://a"]})
    with pytest.raises(GatewayConfigError, match="allowed_hosts"):
        GatewayConfig.build({"decoders": ["http://a:1"], "media": {"allowed_hosts": ["1.2/99"]}})
    cfg = GatewayConfig.build({"decoders": ["http://a:1/"]})
    assert cfg.decoders == ["http://a:1"] and not cfg.media.allow_http_urls
