"""The tests' port table (tests/helpers.py PORT_BLOCKS): every block disjoint from every other
(modules run side by side on two xdist workers, and beside other lanes), clear of the ports a
default `epd up` holds and of the range the Mooncake engines draw their listeners from (the
port plan, ec_connectors/protocol/ports.py), below the kernel's ephemeral ports, and owned by
a module that exists and uses it."""

from __future__ import annotations

import itertools

import pytest

from ec_connectors.protocol import ports
from tests.helpers import PLANES, PORT_BLOCKS, ROOT, block_footprint, port_block

FOOTPRINTS = {key: block_footprint(key[1], port_block(*key)) for key in PORT_BLOCKS}


def _ephemeral_floor() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return ports.ENGINE_CEILING + 1


def test_blocks_are_disjoint():
    clashes = [(a, b, sorted(FOOTPRINTS[a] & FOOTPRINTS[b])[:3])
               for a, b in itertools.combinations(FOOTPRINTS, 2) if FOOTPRINTS[a] & FOOTPRINTS[b]]
    assert not clashes, clashes


def test_blocks_are_clear_of_the_port_plan_and_the_ephemeral_ports():
    fixed = ports.up_fixed_ports(ports.GATEWAY_PORT, ports.UP_MAX_SERVERS,
                                 ports.MOONCAKE_BASE_PORT, ports.UP_MAX_SERVERS,
                                 ports.MASTER_RPC_PORT)  # a default `epd up` at its largest
    engines = set(range(ports.ENGINE_PORTS[0], ports.ENGINE_PORTS[1] + 1))
    floor = _ephemeral_floor()
    for key, footprint in FOOTPRINTS.items():
        assert not footprint & set(fixed), (key, sorted(footprint & set(fixed))[:3])
        assert not footprint & engines, (key, "inside the Mooncake engines' range")
        assert min(footprint) >= 1024 and max(footprint) < floor, (key, "ephemeral ports")
    # what an engine started by a test picks: the plan's range, whatever the tests hold
    assert ports.engine_ports(set().union(*FOOTPRINTS.values())) == ports.ENGINE_PORTS


@pytest.mark.parametrize("module, kind", sorted(PORT_BLOCKS))
def test_each_block_is_a_modules_that_takes_it(module, kind):
    assert kind in PLANES
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    assert path.exists(), f"{module}: no such test module (a stale block)"
    text = path.read_text()
    assert "port_block(__name__" in text or "base_ports(__name__" in text, \
        f"{module}: owns a block but does not take it"


def test_the_benchmarks_default_ports_are_clear_of_every_test_block():
    """Benchmarks run under the machine's vLLM lock while fast-lane tests may run beside them:
    their default ports (`PORT = ...`, `--base-port`/`--master-port` defaults, each with the
    ten ports after it) must not fall in a test module's block."""
    import re

    held = set().union(*FOOTPRINTS.values())
    found = {}
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        text = path.read_text()
        for m in re.finditer(r"^(?:BASE_)?PORT = (\d+)|\"--(?:base|master)-port\", type=int, "
                             r"default=(\d+)", text, re.MULTILINE):
            first = int(m.group(1) or m.group(2))
            found[(str(path.relative_to(ROOT)), first)] = held & set(range(first, first + 10))
    assert len(found) >= 6  # the pattern still finds them
    assert not {k: sorted(v)[:3] for k, v in found.items() if v}
