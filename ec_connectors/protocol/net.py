"""Addresses for the peer-to-peer transports: this node's host, `host:port` endpoints (parsed
and validated) and whether something listens at one. The port scheme lives in
`ec_connectors.protocol.ports`."""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
from typing import Annotated

from pydantic import AfterValidator, Field

_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def resolve_host(host: str) -> str:
    """`auto`: the address of the interface that routes outward (a UDP connect sends nothing),
    then the hostname's address, then 127.0.0.1. Anything else is returned as given."""
    if host != "auto":
        return host
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))
        addr = s.getsockname()[0]
        if addr and not addr.startswith("0."):
            return addr
    with contextlib.suppress(OSError):
        addr = socket.gethostbyname(socket.gethostname())
        if addr:
            return addr
    return "127.0.0.1"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """`host:port` -> (host, port); raises ValueError on anything else (untrusted input)."""
    if not isinstance(endpoint, str) or len(endpoint) > 300:
        raise ValueError("an endpoint must be a 'host:port' string")
    host, sep, port_s = endpoint.rpartition(":")
    if not sep or not port_s.isdigit():
        raise ValueError(f"endpoint {endpoint!r} is not 'host:port'")
    port = int(port_s)
    if not 0 < port < 65536:
        raise ValueError(f"endpoint {endpoint!r}: port out of range")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOST.match(host):
            raise ValueError(f"endpoint {endpoint!r}: bad host") from None
    return host, port


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether a TCP connection to `host:port` opens within `timeout_s` (closed at once)."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _check_endpoints(value: list[str]) -> list[str]:
    for endpoint in value:
        parse_endpoint(endpoint)  # ValueError names the bad one
    return value


def _check_endpoint(value: str) -> str:
    parse_endpoint(value)
    return value


# A config field holding `host:port` endpoints (producers), validated in one place.
EndpointList = Annotated[list[str], AfterValidator(_check_endpoints), Field(max_length=256)]
Endpoint = Annotated[str, AfterValidator(_check_endpoint)]
