"""Fetching media by URL without server-side request forgery.

Policy (MediaConfig): http(s) URLs are refused unless `allow_http_urls`; other schemes are
always refused. A URL's host must resolve only to globally reachable addresses (IANA's
special-purpose registries, as `ipaddress.is_global` has them: loopback, link-local, private,
carrier-grade NAT 100.64.0.0/10 (cloud metadata 100.100.100.200), documentation, benchmarking,
reserved...; multicast too; IPv4 inside IPv6 (mapped, NAT64, 6to4, Teredo) is checked as
IPv4) unless the host name or a CIDR containing the address is in `allowed_hosts`.
The fetch connects to the address that was checked (the URL's host is replaced by it; Host
header and TLS SNI/verification keep the name), so a second DNS answer (rebinding) is never
used. Redirects are followed by hand, each hop checked the same way. Responses must not be
compressed (`Accept-Encoding: identity`; a compressed answer is refused: a gzip bomb would
expand before the byte cap); the body is read with that cap and a deadline.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from urllib.parse import urljoin, urlsplit

import httpx

from encoder_service.gateway.config import LimitsConfig, MediaConfig
from encoder_service.gateway.wire import GatewayError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, NAT64, 6to4, Teredo client)."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    return None


def _forbidden_ip(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_v4(ip)
        if inner is not None:
            return _forbidden_ip(inner)
    return not ip.is_global or ip.is_multicast


def _allowed(host: str, ip: IPAddress, media: MediaConfig) -> bool:
    for entry in media.allowed_hosts:
        if "/" in entry:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        elif entry == host:
            return True
    return False


Resolver = Callable[[str, int], Awaitable[list[str]]]


async def check_destination(url: str, media: MediaConfig,
                            resolve: Resolver | None = None) -> IPAddress:
    """Check that a media URL may be fetched; the address to connect to.

    The address to connect to for `url` (every address the name resolves to was checked);
    GatewayError unless it may be fetched under `media`'s policy. `resolve(host, port)`:
    a test's resolver (default: the event loop's getaddrinfo)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise GatewayError(400, f"unsupported media URL scheme {parts.scheme!r}: send a "
                           "data: URL", "bad_url")
    if not media.allow_http_urls:
        raise GatewayError(400, "http(s) media URLs are disabled on this gateway "
                           "(media.allow_http_urls); send the media as a data: URL",
                           "url_disabled")
    host = (parts.hostname or "").lower()
    if not host:
        raise GatewayError(400, "media URL has no host", "bad_url")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise GatewayError(400, "media URL has an invalid port", "bad_url") from None
    try:
        if resolve is not None:
            addresses = await resolve(host, port)
        else:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                                 type=socket.SOCK_STREAM)
            addresses = [info[4][0] for info in infos]
        ips = [ipaddress.ip_address(a.split("%", 1)[0]) for a in addresses]
    except (OSError, ValueError):
        raise GatewayError(400, f"media URL host {host!r} does not resolve",
                           "bad_url") from None
    if not ips:
        raise GatewayError(400, f"media URL host {host!r} does not resolve", "bad_url")
    for ip in ips:
        if _forbidden_ip(ip) and not _allowed(host, ip, media):
            raise GatewayError(403, f"media URL host {host!r} resolves to a non-public "
                               f"address ({ip}); refused (media.allowed_hosts)",
                               "forbidden_url")
    return ips[0]


def _pinned(url: str, ip: IPAddress) -> tuple[str, dict[str, str], dict[str, str]]:
    """Aim a URL at a checked IP address, keeping its host name for HTTP and TLS.

    `url` aimed at `ip`, with the headers and request extensions that keep the host name
    for the server (Host) and for TLS (SNI, certificate check)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{ip}]" if ip.version == 6 else str(ip)
    if parts.port is not None:
        netloc += f":{parts.port}"
    name = f"[{host}]" if ":" in host else host
    host_header = name if parts.port is None else f"{name}:{parts.port}"
    headers = {"host": host_header, "accept-encoding": "identity"}
    extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
    return parts._replace(netloc=netloc).geturl(), headers, extensions


async def fetch_media(client: httpx.AsyncClient, url: str, media: MediaConfig,
                      limits: LimitsConfig, resolve: Resolver | None = None
                      ) -> tuple[bytes, str | None]:
    """Fetch media from a URL, checking every hop.

    The bytes and content type at `url`, every hop checked; 4xx GatewayError on refusal,
    502/504 when the remote side fails or is too slow."""
    async def run() -> tuple[bytes, str | None]:
        nonlocal url
        for _ in range(media.max_redirects + 1):
            ip = await check_destination(url, media, resolve)
            target, headers, extensions = _pinned(url, ip)
            async with client.stream("GET", target, headers=headers, extensions=extensions,
                                     follow_redirects=False) as resp:
                if resp.is_redirect and "location" in resp.headers:
                    url = urljoin(url, resp.headers["location"])
                    continue
                if resp.status_code != 200:
                    raise GatewayError(502, f"media URL answered HTTP {resp.status_code}",
                                       "url_fetch_failed")
                encoding = resp.headers.get("content-encoding", "identity").lower()
                if encoding not in ("", "identity"):
                    raise GatewayError(502, f"media URL answered compressed ({encoding}) "
                                       "although asked not to; refused", "url_fetch_failed")
                data = bytearray()
                async for chunk in resp.aiter_raw():
                    data += chunk
                    if len(data) > limits.max_media_bytes:
                        raise GatewayError(413, "media at URL is larger than "
                                           f"{limits.max_media_bytes} bytes",
                                           "media_too_large")
                return bytes(data), resp.headers.get("content-type")
        raise GatewayError(400, "media URL redirects too many times", "bad_url")
    try:
        return await asyncio.wait_for(run(), media.url_fetch_timeout_s)
    except asyncio.TimeoutError:
        raise GatewayError(504, "fetching the media URL timed out", "url_timeout") from None
    except httpx.HTTPError as exc:
        raise GatewayError(502, f"fetching the media URL failed: {type(exc).__name__}",
                           "url_fetch_failed") from None
