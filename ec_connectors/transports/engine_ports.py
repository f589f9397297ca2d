"""The port plan in a process that starts a Mooncake engine.

The port plan (ec_connectors/protocol/ports.py) in a process that starts a Mooncake engine
(a Transfer Engine, a Store client): before mooncake is first imported, MC_MIN_RPC_PORT /
MC_MAX_RPC_PORT are set to a range clear of the fixed ports this process knows on its host
(its producer ports, local producers it pulls from, a local store master), or a range set
in the environment is checked against them. `epd up` passes the range it planned for the
whole deployment; processes started by hand (README, compose, k8s) plan their own."""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import MutableMapping

from ec_connectors.config import EPDConfig
from ec_connectors.log import get_logger
from ec_connectors.protocol import ports
from epd_common.net import parse_endpoint, resolve_host

logger = get_logger(__name__)


class EngineRangeError(RuntimeError):
    """MC_MIN_RPC_PORT / MC_MAX_RPC_PORT overlap a fixed port (or are no valid range)."""


def _local(host: str, own: str) -> bool:
    if host in ("localhost", own):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_fixed_ports(config: EPDConfig) -> dict[int, str]:
    """The fixed ports of EPD processes on this host that `config` names -> what they are."""
    fixed: dict[int, str] = {}
    own = resolve_host(config.host)
    if "mooncake" in config.tiers:
        base = config.base_port + config.stage_offset
        fixed.update(dict.fromkeys(ports.purpose_block(base),
                                   f"side channels of base_port {config.base_port}"))
        for endpoint in config.producers:
            host, port = parse_endpoint(endpoint)
            if _local(host, own):
                fixed.update(dict.fromkeys(ports.producer_ports(port), f"producer {endpoint}"))
    if "mooncake_store" in config.tiers:
        host, port = parse_endpoint(config.store_master)
        if _local(host, own):
            fixed.update(dict.fromkeys(ports.master_ports(port), "the store master"))
    return fixed


def plan_engine_ports(config: EPDConfig, module: str,
                      environ: MutableMapping[str, str] = os.environ) -> tuple[int, int]:
    """Set this process's Mooncake engine port range before mooncake is imported.

    Put this process's engine range in `environ` (kept when set there and clear of the
    fixed ports; refused with EngineRangeError naming the collisions when not) before
    `module` (mooncake.engine, mooncake.store) is imported: Mooncake reads it only then."""
    try:
        env = ports.engine_env(local_fixed_ports(config), environ)
    except ValueError as exc:
        raise EngineRangeError(str(exc)) from None
    first, last = int(env[ports.ENGINE_MIN_ENV]), int(env[ports.ENGINE_MAX_ENV])
    if module in sys.modules and any(environ.get(k) != v for k, v in env.items()):
        logger.warning("EPD: %s was imported before the port plan: its engine takes ports "
                       "from %s-%s as they were then, not %d-%d", module,
                       environ.get(ports.ENGINE_MIN_ENV, "15000"),
                       environ.get(ports.ENGINE_MAX_ENV, "17000"), first, last)
    environ.update(env)
    return first, last
