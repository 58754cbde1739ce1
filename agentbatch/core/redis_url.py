"""Redis URLs: which schemes agentbatch speaks, how a URL is checked, masked and parsed.

Pure string work, kept apart from the clients (``distributed/state/connection.py``) so the
submit side can refuse a bad ``redis_url`` and mask one in a message without the Redis layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit, urlunsplit

from agentbatch.core.errors import ConfigError

REDIS_SCHEMES = ("redis", "rediss", "unix", "sentinel")
SENTINEL_PORT = 26379
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster", "redis-cluster", "cluster")
SENTINEL_TLS_SCHEMES = ("sentinels", "rediss+sentinel", "sentinel+tls", "sentinel+ssl")
CLUSTER_UNSUPPORTED = (
    "Redis Cluster is not supported: agentbatch commits an agent's step in one atomic Lua "
    "script that touches the batch's keys, the global ab:batches set and ab:watch zset and "
    "the Celery queue lists together, and Cluster runs a script only on keys of one hash "
    "slot. For high "
    "availability use Redis Sentinel (a primary, a replica, three sentinels) with a "
    "sentinel://host1:26379,host2:26379,host3:26379/primary_name URL (docs/failover.md)"
)
TLS_FILE_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
_VERIFIED = ("required", "cert_required")
_CHECKED = ("true", "1", "yes", "on")  # what redis-py reads as ssl_check_hostname on

def _split(url: str) -> SplitResult | None:
    """``urlsplit(url)`` when the URL is well formed (a valid port, nothing after the path
    that only an unencoded password would put there); None otherwise."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a malformed port
    except ValueError:
        return None
    if parts.fragment or "#" in url or "@" in parts.path or "@" in parts.query:
        return None  # a '#', '/' or '@' inside the password split the URL in the wrong place
    return parts


def url_scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "?"


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``sentinel://`` URL: where the sentinels are and which primary to ask for."""

    hosts: tuple[tuple[str, int], ...]
    service: str
    db: int
    username: str | None
    password: str | None


def split_sentinel(url: str) -> tuple[str, str, list[str], str, str] | None:
    """(userinfo, raw hosts, host list, path, query) of a sentinel:// URL, or None when it
    does not split cleanly (an unencoded '@', '/', '#' or '?' in the password)."""
    rest = url.split("://", 1)[1]
    if "#" in rest:
        return None
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    if "@" in userinfo or "@" in path or "@" in query:
        return None
    return userinfo, hosts, hosts.split(","), path, query


def parse_sentinel(url: str) -> SentinelURL:
    """The sentinels, primary name, db and credentials of a ``sentinel://`` URL."""
    split = split_sentinel(url)
    if split is None:
        raise ConfigError(
            "the Redis URL sentinel://... could not be parsed; reserved characters in a "
            "password (@ : / # ? % and so on) must be percent-encoded, e.g. "
            "urllib.parse.quote(password, safe='')")
    userinfo, _, host_list, path, query = split
    masked = mask_url(url)
    hosts: list[tuple[str, int]] = []
    for item in host_list:
        try:
            parts = urlsplit(f"//{item}")
            port = parts.port or SENTINEL_PORT
        except ValueError:
            raise ConfigError(f"{masked}: {item!r} is not host[:port]") from None
        if not item or not parts.hostname:
            raise ConfigError(f"{masked}: a sentinel address is empty; list them as "
                              "host1:26379,host2:26379,host3:26379")
        hosts.append((parts.hostname, port))
    service = unquote(path.strip("/"))
    if not service or "/" in service:
        raise ConfigError(f"{masked}: name the primary after the sentinels' addresses, as in "
                          "sentinel://host1:26379,host2:26379/mymaster (the name given to "
                          "'sentinel monitor')")
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - {"db"})
    if unknown:
        raise ConfigError(f"{masked}: {', '.join(unknown)}: not an option of a sentinel:// "
                          "URL (only db=N; TLS through Sentinel is not supported)")
    try:
        db = int(options.get("db", "0"))
    except ValueError:
        raise ConfigError(f"{masked}: db={options['db']!r} is not a database number") from None
    user, colon, password = userinfo.partition(":")
    return SentinelURL(tuple(hosts), service, db, unquote(user) or None,
                       unquote(password) if colon else None)


def _mask_sentinel(url: str) -> str:
    split = split_sentinel(url)
    if split is None:
        return "sentinel://<malformed URL hidden>"
    userinfo, hosts, _, path, query = split
    user, colon, _ = userinfo.partition(":")
    auth = f"{user}:***@" if colon else (f"{user}@" if user else "")
    return f"sentinel://{auth}{hosts}/{path}" + (f"?{query}" if query else "")


def mask_url(url: str) -> str:
    """The URL without its password, safe for logs and error messages."""
    if url_scheme(url) == "sentinel":
        return _mask_sentinel(url)
    parts = _split(url)
    if parts is None:
        return f"{url_scheme(url)}://<malformed URL hidden>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, ""))


def check_url(url: str) -> None:
    """Refuse what is not a usable Redis URL with a ``ConfigError`` that never shows a secret."""
    if not isinstance(url, str):
        raise ConfigError(f"the Redis URL must be a string, got {type(url).__name__}")
    scheme = url_scheme(url)
    if scheme in CLUSTER_SCHEMES:
        raise ConfigError(f"{scheme}://...: {CLUSTER_UNSUPPORTED}")
    if scheme in SENTINEL_TLS_SCHEMES:
        raise ConfigError(f"{scheme}://...: TLS through Redis Sentinel is not supported; use "
                          "sentinel:// on a private network, or rediss:// to one primary")
    if scheme == "sentinel":
        parse_sentinel(url)
        return
    parts = _split(url)
    if parts is None:
        raise ConfigError(
            f"the Redis URL {url_scheme(url)}://... could not be parsed (a malformed password, "
            "port or path); reserved characters in a password (@ : / # ? % and so on) must "
            "be percent-encoded, e.g. urllib.parse.quote(password, safe='')"
        )
    if parts.scheme not in REDIS_SCHEMES:
        raise ConfigError(f"not a Redis URL: {mask_url(url)} (use redis://, rediss://, unix:// or "
                          "sentinel://)")
    if parts.scheme == "unix" and not parts.path:
        raise ConfigError(f"{mask_url(url)}: a unix:// URL needs the socket's path, "
                          "e.g. unix:///run/redis/redis.sock?db=0")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    tls = [k for k in (*TLS_FILE_OPTIONS, "ssl_cert_reqs", "ssl_check_hostname")
           if k in query]
    if tls and parts.scheme != "rediss":
        raise ConfigError(f"{mask_url(url)}: {', '.join(tls)} only apply to rediss:// URLs")
    reqs = query.get("ssl_cert_reqs")
    if reqs is not None and reqs.lower() not in _VERIFIED:
        raise ConfigError(
            f"{mask_url(url)}: ssl_cert_reqs={reqs}: agentbatch only speaks verified TLS; give "
            "the server's CA with ?ssl_ca_certs=/path/to/ca.pem instead"
        )
    check = query.get("ssl_check_hostname")
    if check is not None and check.lower() not in _CHECKED:
        raise ConfigError(
            f"{mask_url(url)}: ssl_check_hostname={check}: agentbatch always checks that the "
            "server's certificate names the host in the URL; connect by a name the "
            "certificate lists, or reissue it with that name"
        )
