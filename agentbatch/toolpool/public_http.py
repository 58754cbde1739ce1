"""HTTP GET for a model-chosen URL that reaches only public addresses (no SSRF).

The host is resolved here, every address is checked, and the request then goes to the
checked address itself (the Host header and TLS SNI/certificate check keep the name), so a
DNS answer cannot change between the check and the connection. Redirects are followed by
hand, each hop checked the same way, at most ``MAX_REDIRECTS`` of them. Proxies and other
settings from the environment are ignored (``trust_env=False``).

Refused: every address that is not globally reachable (``is_public``), also when written in
decimal/hex or embedded in IPv6 (IPv4-mapped, IPv4-translated, IPv4-compatible, 6to4, NAT64,
Teredo: the embedded IPv4 address is judged too). An IPv6 address must be global unicast
(2000::/3), so deprecated, translated and local ranges (site-local fec0::/10, local-use NAT64
64:ff9b:1::/48, ``::a00:1``, ``::ffff:0:a00:1``) are refused by what they are not.
``AGENTBATCH_HTTP_ALLOW=host,host`` lets the listed hosts (names, addresses or networks)
through even when they are private; cloud-metadata addresses are refused even then.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
from dataclasses import dataclass

import httpx

from agentbatch.core.errors import ToolError

__all__ = [
    "HTTP_ALLOW_ENV", "MAX_REDIRECTS", "Allowlist", "address_refusal", "fetch_public",
    "http_allowlist", "is_public", "public_client", "resolve_checked",
]  # fmt: skip

HTTP_ALLOW_ENV = "AGENTBATCH_HTTP_ALLOW"
MAX_REDIRECTS = 5
_REDIRECTS = {301, 302, 303, 307, 308}
_IP = ipaddress.IPv4Address | ipaddress.IPv6Address
_NET = ipaddress.IPv4Network | ipaddress.IPv6Network
METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean
    "169.254.170.2",  # AWS ECS task credentials
    "fd00:ec2::254",  # AWS over IPv6
    "100.100.100.200",  # Alibaba Cloud
    "192.0.0.192",  # Oracle Cloud
))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")  # SIIT, RFC 2765
_COMPAT = ipaddress.ip_network("::/96")  # deprecated IPv4-compatible (:: and ::1 included)
_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")
# IANA special-purpose blocks, not globally reachable, that Python 3.11 calls global
# (192.0.0.0/24: IETF protocol assignments, 192.0.0.8 among them; 3fff::/20: documentation).
_NOT_GLOBAL = (ipaddress.ip_network("192.0.0.0/24"), ipaddress.ip_network("3fff::/20"))


@dataclass(frozen=True)
class Allowlist:
    """Hosts the operator vouches for: exact names (lowercase) and address networks."""

    names: frozenset[str] = frozenset()
    networks: tuple[_NET, ...] = ()

    def allows(self, host: str, address: _IP) -> bool:
        return host.lower().rstrip(".") in self.names or any(
            address.version == n.version and address in n for n in self.networks)


def http_allowlist(raw: str | None = None) -> Allowlist:
    """Parse ``AGENTBATCH_HTTP_ALLOW`` (or ``raw``): comma-separated names, IPs or networks."""
    raw = os.environ.get(HTTP_ALLOW_ENV, "") if raw is None else raw
    names: set[str] = set()
    networks: list[_NET] = []
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
        except ValueError:
            names.add(entry.lower().rstrip("."))
    return Allowlist(frozenset(names), tuple(networks))


def _embedded_v4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64 or address in _TRANSLATED or address in _COMPAT:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def is_public(address: _IP) -> bool:
    """Globally reachable unicast: ``is_global``, not multicast, not a special-purpose block
    older Pythons miss, and for IPv6 inside global unicast 2000::/3 (``address_refusal``
    judges an embedded IPv4 address as well)."""
    if not address.is_global or address.is_multicast:
        return False
    if any(address.version == net.version and address in net for net in _NOT_GLOBAL):
        return False
    return address.version == 4 or address in _GLOBAL_UNICAST


def address_refusal(host: str, address: _IP, allow: Allowlist) -> str | None:
    """Why ``host`` at ``address`` may not be fetched, or None when it may (a pure decision)."""
    inner = _embedded_v4(address) if isinstance(address, ipaddress.IPv6Address) else None
    for a in (address, inner):
        if a is not None and a in METADATA:
            return f"{address} is a cloud metadata address"
    if allow.allows(host, address):
        return None
    for a in (address, inner):  # both: a 6to4 address of a private IPv4 host is private
        if a is not None and not is_public(a):
            return (f"{address} is not a public address (loopback, private, link-local, "
                    f"CGNAT, multicast, reserved or another non-global range); an operator "
                    f"can allow a host with {HTTP_ALLOW_ENV}=host,host")
    return None


async def resolve_checked(url: httpx.URL, allow: Allowlist) -> _IP:
    """The address to connect to for ``url``, after checking every address the name has."""
    host = url.raw_host.decode("ascii")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise ToolError(f"http_get: cannot resolve {host!r}: {exc}") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not addresses:
        raise ToolError(f"http_get: {host!r} has no address")
    for address in addresses:  # all of them: a mixed answer must not pass half-checked
        reason = address_refusal(host, address, allow)
        if reason is not None:
            raise ToolError(f"http_get refused {str(url)!r}: {reason}")
    return addresses[0]


def _pinned(url: httpx.URL, address: _IP) -> httpx.Request:
    """A GET to ``address`` that still names ``url``'s host (Host header, SNI, cert check)."""
    host_header = url.netloc.decode("ascii").rpartition("@")[2]
    request = httpx.Request("GET", url.copy_with(host=str(address)),
                            headers={"Host": host_header})
    if url.scheme == "https":
        request.extensions["sni_hostname"] = url.raw_host.decode("ascii")
    return request


async def fetch_public(client: httpx.AsyncClient, url: httpx.URL,
                       allow: Allowlist) -> tuple[httpx.Response, httpx.URL]:
    """The first non-redirect response for ``url`` (open: the caller reads and closes it)."""
    for _ in range(MAX_REDIRECTS + 1):
        address = await resolve_checked(url, allow)
        response = await client.send(_pinned(url, address), stream=True)
        location = response.headers.get("location")
        if response.status_code not in _REDIRECTS or not location:
            return response, url
        await response.aclose()
        try:
            url = url.join(location)
        except Exception as exc:
            raise ToolError(f"http_get: bad redirect to {location!r}: {exc}") from None
        if url.scheme not in ("http", "https") or not url.host:
            raise ToolError(f"http_get: refused a redirect to {str(url)!r} (not http/https)")
    raise ToolError(f"http_get: more than {MAX_REDIRECTS} redirects")


def public_client(timeout: float) -> httpx.AsyncClient:
    """A client that ignores proxy settings and never follows redirects by itself."""
    return httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False)
