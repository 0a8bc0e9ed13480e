"""Fetching a remote image URL without letting DNS decide where the gateway connects.

A URL's host must be in the allow list (or a subdomain of an entry); the name is resolved
once (getaddrinfo in the loop's executor) and every address it resolves to must be global
unicast: not loopback, RFC 1918, CGNAT, link-local (169.254.169.254), ULA, site-local,
multicast, reserved or unspecified, nor such an IPv4 address inside an IPv6 one (mapped,
compatible, 6to4, NAT64, Teredo), unless it lies in an allowed network. The gateway then
connects to the checked address itself, with the URL's Host header and the name as TLS
SNI and certificate name, so a second lookup (DNS rebinding) cannot move it. One deadline
covers resolving, connecting and the whole body; no redirects, no proxy or CA settings from
the environment, a byte cap.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import httpx

from gateway.errors import InvalidRequest

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# host, port -> the addresses to choose from (the injectable DNS of a MediaFetcher)
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")


async def resolve(host: str, port: int) -> list[str]:
    """The addresses of `host` (getaddrinfo off the event loop), in the system's order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, Teredo client, NAT64, compatible)."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64 or address in _IPV4_COMPATIBLE:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def is_global_unicast(address: IPAddress) -> bool:
    """Whether connecting to `address` leaves this host's networks: a global unicast address
    that embeds no inward IPv4 address."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = embedded_ipv4(address)
        if (inner is not None and not is_global_unicast(inner)) or address.is_site_local:
            return False
    inward = (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )
    return address.is_global and not inward


def _in_domains(host: str, domains: Sequence[str]) -> bool:
    return any(host == d or host.endswith("." + d) for d in domains)


@dataclass
class MediaFetcher:
    """GET one image URL under the gateway's media rules (GatewayConfig's media fields)."""

    allowed_domains: tuple[str, ...] = ()  # empty: no remote fetching
    allowed_networks: tuple[str, ...] = ()  # CIDRs allowed although not global unicast
    timeout_s: float = 10.0  # the whole fetch: resolve, connect, headers, body
    max_bytes: int = 20 << 20
    resolver: Resolver = resolve
    transport: httpx.AsyncBaseTransport | None = None  # None: httpx's own connections
    verify: ssl.SSLContext | bool = True  # certificate checking (tests pass their CA)
    _networks: tuple[IPNetwork, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._networks = tuple(ipaddress.ip_network(n, strict=False) for n in self.allowed_networks)

    async def fetch(self, url: str) -> bytes:
        """The body of `url`; InvalidRequest (400) when a rule refuses it or it fails."""
        target = self._target(url)
        try:
            async with asyncio.timeout(self.timeout_s):
                address = await self._address(target)
                return await self._get(target, address)
        except TimeoutError:
            raise InvalidRequest(
                f"fetching the image took over {self.timeout_s:g} s", "messages"
            ) from None

    def _target(self, url: str) -> httpx.URL:
        """The parsed URL, once its scheme, credentials and host pass the rules."""
        try:
            target = httpx.URL(url)
        except (httpx.InvalidURL, TypeError):
            raise InvalidRequest("image_url is not a valid URL", "messages") from None
        if target.scheme not in ("http", "https"):
            raise InvalidRequest("image_url must be a data: or http(s) URL", "messages")
        if not self.allowed_domains:
            raise InvalidRequest("remote image URLs are off", "messages")
        if target.userinfo:
            raise InvalidRequest("image URLs must not carry credentials (user@host)", "messages")
        names = {target.host.lower(), target.raw_host.decode("ascii").lower()}
        if not names - {""} or not all(_in_domains(n, self.allowed_domains) for n in names):
            raise InvalidRequest(
                f"image host {target.host!r} is not in --allowed-media-domains", "messages"
            )
        return target

    async def _address(self, target: httpx.URL) -> str:
        """The address to connect to: every address of the host checked, the first taken."""
        host = target.raw_host.decode("ascii")
        port = target.port or (443 if target.scheme == "https" else 80)
        try:
            found = [
                ipaddress.ip_address(a.partition("%")[0]) for a in await self.resolver(host, port)
            ]
        except (OSError, ValueError):
            raise InvalidRequest(f"cannot resolve the image host {host!r}", "messages") from None
        refused = [a for a in found if not self._allowed(a)]
        if refused or not found:
            log.warning("image host %r resolves to %s: refused", host, [str(a) for a in refused])
            raise InvalidRequest(
                f"image host {host!r} does not resolve to public addresses only "
                "(see --allowed-media-networks)",
                "messages",
            )
        return str(found[0])

    def _allowed(self, address: IPAddress) -> bool:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in n for n in self._networks) or is_global_unicast(address)

    async def _get(self, target: httpx.URL, address: str) -> bytes:
        """GET `target` from `address`: Host, SNI and the certificate name stay the URL's."""
        extensions = {"sni_hostname": target.raw_host.decode("ascii")}
        client = httpx.AsyncClient(
            transport=self.transport,
            verify=self.verify,
            timeout=self.timeout_s,
            follow_redirects=False,
            trust_env=False,
        )
        try:
            async with client:
                request = client.build_request(
                    "GET",
                    target.copy_with(host=address),
                    headers={"Host": target.netloc.decode("ascii"), "Accept-Encoding": "identity"},
                    extensions=extensions if target.scheme == "https" else {},
                )
                response = await client.send(request, stream=True)
                try:
                    return await self._body(response)
                finally:
                    await response.aclose()
        except httpx.HTTPError as exc:
            raise InvalidRequest(f"cannot fetch the image: {type(exc).__name__}") from None

    async def _body(self, response: httpx.Response) -> bytes:
        if response.status_code != 200:
            raise InvalidRequest(f"fetching the image gave HTTP {response.status_code}")
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            raise InvalidRequest(f"image is over the {self.max_bytes}-byte cap")
        data = bytearray()
        async for chunk in response.aiter_raw():  # no decompression: no gzip bombs
            data += chunk
            if len(data) > self.max_bytes:
                raise InvalidRequest(f"image is over the {self.max_bytes}-byte cap")
        return bytes(data)
