"""Fetching media by URL without server-side request forgery.

Policy (MediaConfig): http(s) URLs are refused unless `allow_http_urls`; other schemes are
always refused. A URL's host must resolve only to public addresses: loopback, link-local,
private, multicast, reserved and unspecified ranges are refused unless the host name or a
CIDR containing the address is in `allowed_hosts`. Redirects are followed by hand, each hop
checked the same way; the body is read with a byte cap and a deadline.
Residual risk: the check resolves the name, then httpx resolves it again (DNS rebinding
between the two is not prevented); deployments that enable URLs should also egress-filter.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urljoin, urlsplit

import httpx

from encoder_service.gateway.config import LimitsConfig, MediaConfig
from encoder_service.gateway.errors import GatewayError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _forbidden_ip(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
            or ip.is_reserved or ip.is_unspecified)


def _allowed(host: str, ip: IPAddress, media: MediaConfig) -> bool:
    for entry in media.allowed_hosts:
        if "/" in entry:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        elif entry == host:
            return True
    return False


async def check_destination(url: str, media: MediaConfig) -> None:
    """Raise GatewayError unless `url` may be fetched under `media`'s policy."""
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
        infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)
    except OSError:
        raise GatewayError(400, f"media URL host {host!r} does not resolve",
                           "bad_url") from None
    for info in infos:
        ip = ipaddress.ip_address(info[4][0].split("%", 1)[0])
        if _forbidden_ip(ip) and not _allowed(host, ip, media):
            raise GatewayError(403, f"media URL host {host!r} resolves to a non-public "
                               f"address ({ip}); refused (media.allowed_hosts)",
                               "forbidden_url")


async def fetch_media(client: httpx.AsyncClient, url: str, media: MediaConfig,
                      limits: LimitsConfig) -> tuple[bytes, str | None]:
    """The bytes and content type at `url`, every hop checked; 4xx GatewayError on refusal,
    502/504 when the remote side fails or is too slow."""
    async def run() -> tuple[bytes, str | None]:
        nonlocal url
        for _ in range(media.max_redirects + 1):
            await check_destination(url, media)
            async with client.stream("GET", url, follow_redirects=False) as resp:
                if resp.is_redirect and "location" in resp.headers:
                    url = urljoin(url, resp.headers["location"])
                    continue
                if resp.status_code != 200:
                    raise GatewayError(502, f"media URL answered HTTP {resp.status_code}",
                                       "url_fetch_failed")
                data = bytearray()
                async for chunk in resp.aiter_bytes():
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
