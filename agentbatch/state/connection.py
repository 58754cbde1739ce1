"""Redis clients from URLs (passwords, verified rediss:// TLS, unix sockets), secrets masked.

One place decides how a Redis URL becomes a connection, for agentbatch's own clients and for
the Celery broker (``broker_url`` / ``broker_ssl``), so the two never disagree:

* ``rediss://`` always verifies the server's certificate (``CERT_REQUIRED``); the CA, client
  certificate and key come from the URL's ``ssl_ca_certs``, ``ssl_certfile`` and
  ``ssl_keyfile`` query options (the system CAs when no ``ssl_ca_certs`` is given). Asking
  for unverified TLS (``ssl_cert_reqs=none``) is refused.
* ``unix:///path/to/redis.sock?db=N`` works for both (kombu spells it ``redis+socket://``).
* A password must be percent-encoded (``urllib.parse.quote(password, safe="")``); a URL that
  does not parse is refused without echoing any part of it but its scheme.
"""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import SplitResult, parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis

from ..errors import ConfigError

REDIS_SCHEMES = ("redis", "rediss", "unix")
TLS_FILE_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
_VERIFIED = ("required", "cert_required")

_CLIENT_OPTS = {
    "decode_responses": True,
    "socket_keepalive": True,
    "socket_connect_timeout": 5,
    "health_check_interval": 15,
    "retry_on_timeout": True,
}
_TCP_ONLY_OPTS = ("socket_keepalive", "socket_keepalive_options")


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


def _scheme(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "?"


def mask_url(url: str) -> str:
    """The URL without its password, safe for logs and error messages."""
    parts = _split(url)
    if parts is None:
        return f"{_scheme(url)}://<malformed URL hidden>"
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
    parts = _split(url)
    if parts is None:
        raise ConfigError(
            f"the Redis URL {_scheme(url)}://... could not be parsed (a malformed password, "
            "port or path); reserved characters in a password (@ : / # ? % and so on) must "
            "be percent-encoded, e.g. urllib.parse.quote(password, safe='')"
        )
    if parts.scheme not in REDIS_SCHEMES:
        raise ConfigError(f"not a Redis URL: {mask_url(url)} (use redis://, rediss:// or unix://)")
    if parts.scheme == "unix" and not parts.path:
        raise ConfigError(f"{mask_url(url)}: a unix:// URL needs the socket's path, "
                          "e.g. unix:///run/redis/redis.sock?db=0")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    tls = [k for k in (*TLS_FILE_OPTIONS, "ssl_cert_reqs") if k in query]
    if tls and parts.scheme != "rediss":
        raise ConfigError(f"{mask_url(url)}: {', '.join(tls)} only apply to rediss:// URLs")
    reqs = query.get("ssl_cert_reqs")
    if reqs is not None and reqs.lower() not in _VERIFIED:
        raise ConfigError(
            f"{mask_url(url)}: ssl_cert_reqs={reqs}: agentbatch only speaks verified TLS; give "
            "the server's CA with ?ssl_ca_certs=/path/to/ca.pem instead"
        )


def broker_ssl(url: str) -> dict[str, Any] | None:
    """Celery's ``broker_use_ssl`` for ``url``: verified TLS for rediss://, else None."""
    check_url(url)
    parts = urlsplit(url)
    if parts.scheme != "rediss":
        return None
    query = dict(parse_qsl(parts.query))
    options: dict[str, Any] = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    options.update({k: query[k] for k in TLS_FILE_OPTIONS if query.get(k)})
    return options


def broker_url(url: str) -> str:
    """``url`` as kombu's Redis transport reads it.

    unix:// becomes ``redis+socket://`` (db as ``virtual_host``); rediss:// loses its TLS
    query options, which ``broker_ssl`` hands to kombu instead."""
    check_url(url)
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
             if k not in (*TLS_FILE_OPTIONS, "ssl_cert_reqs")]
    if parts.scheme == "unix":
        query = [("virtual_host", v) if k == "db" else (k, v) for k, v in query]
        auth = parts.netloc.rpartition("@")[0]
        netloc = f"{auth}@" if auth else ""
        encoded = urlencode(query)
        return f"redis+socket://{netloc}{parts.path}" + (f"?{encoded}" if encoded else "")
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), ""))


def _options(url: str, overrides: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    check_url(url)
    scheme = urlsplit(url).scheme
    options = {**_CLIENT_OPTS, **defaults, **overrides}
    if scheme == "unix":  # a unix socket has no TCP keepalive; redis-py rejects the option
        for name in _TCP_ONLY_OPTS:
            options.pop(name, None)
    if scheme == "rediss":
        options["ssl_cert_reqs"] = "required"
    return options


def async_client(url: str, **overrides: Any) -> aioredis.Redis:
    return aioredis.from_url(url, **_options(url, overrides, {"max_connections": 256}))


def sync_client(url: str, **overrides: Any) -> redis.Redis:
    return redis.from_url(url, **_options(url, overrides, {}))
