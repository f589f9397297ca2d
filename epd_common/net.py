"""Host addresses, endpoints and port checks for the peer-to-peer transports.

Addresses for the peer-to-peer transports: this node's host, `host:port` endpoints (parsed
and validated), whether something listens at one and which process (`port_holder`, for a
bind failure's message). The port plan lives in `ec_connectors.protocol.ports`."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import socket
from typing import Annotated

from pydantic import AfterValidator, Field

_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def resolve_host(host: str) -> str:
    """Resolve a configured host (`auto` or an address) to the address to use.

    `auto`: the address of the interface that routes outward (a UDP connect sends nothing),
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


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (or `localhost`)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


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


_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


def port_holder(port: int) -> str:
    """Name the process that listens on a TCP port of this host, for error messages.

    Who listens on TCP `port` on this host (this network namespace), for a bind failure's
    message: "pid N (its command line)", found from /proc/net/tcp{,6} and /proc/*/fd (Linux);
    "a process of another user" when only the socket shows; "" when nothing listens there
    or /proc cannot tell."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError, ValueError, IndexError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return ""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        return f"pid {pid} ({_command(pid)})"
    return "a process of another user"


def holders(ports: list[int]) -> str:
    """Name the processes that hold any of `ports`, for error messages.

    "port P is held by ..." for each of `ports` a process listens on (`port_holder`), "; "
    between them; "" when none can be found."""
    return "; ".join(f"port {p} is held by {h}" for p in ports if (h := port_holder(p)))


def _command(pid: str) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
        return " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())[:200] \
            or "?"
    return "?"


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
