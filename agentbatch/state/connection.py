"""Redis clients from URLs (passwords and rediss:// TLS included), with secrets masked."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis

from ..errors import ConfigError

_CLIENT_OPTS = {
    "decode_responses": True,
    "socket_keepalive": True,
    "socket_connect_timeout": 5,
    "health_check_interval": 15,
    "retry_on_timeout": True,
}


def mask_url(url: str) -> str:
    """The URL without its password, safe for logs and error messages."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable redis url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, ""))


def check_url(url: str) -> None:
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"not a Redis URL: {mask_url(url)} (use redis://, rediss:// or unix://)")


def async_client(url: str, **overrides: object) -> aioredis.Redis:
    check_url(url)
    return aioredis.from_url(url, **{**_CLIENT_OPTS, "max_connections": 256, **overrides})


def sync_client(url: str, **overrides: object) -> redis.Redis:
    check_url(url)
    return redis.from_url(url, **{**_CLIENT_OPTS, **overrides})
