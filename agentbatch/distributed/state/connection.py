"""Redis clients from URLs (passwords, verified rediss:// TLS, unix sockets), secrets masked.

One place decides how a Redis URL becomes a connection, for agentbatch's own clients and for
the Celery broker (``broker_url`` / ``broker_ssl``), so the two never disagree:

* ``rediss://`` always verifies the server's certificate (``CERT_REQUIRED``); the CA, client
  certificate and key come from the URL's ``ssl_ca_certs``, ``ssl_certfile`` and
  ``ssl_keyfile`` query options (the system CAs when no ``ssl_ca_certs`` is given). Asking
  for unverified TLS (``ssl_cert_reqs=none``) or for no hostname check
  (``ssl_check_hostname=false``: then any certificate from the CA, any public CA without
  ``ssl_ca_certs``, would be trusted for this host) is refused.
* ``unix:///path/to/redis.sock?db=N`` works for both (kombu spells it ``redis+socket://``).
* A password must be percent-encoded (``urllib.parse.quote(password, safe="")``); a URL that
  does not parse is refused without echoing any part of it but its scheme.
* ``sentinel://[[user]:password@]host1[:26379],host2[:26379],.../primary_name[?db=N]`` reaches
  the primary that Redis Sentinel names ``primary_name``, so agentbatch rides through the
  loss of the primary (docs/failover.md). The password is the primary's (and its
  replicas'); the sentinels are asked without one. kombu gets its own spelling
  (``sentinel://h1:p1;sentinel://h2:p2`` and ``master_name``, see ``broker_transport``). TLS
  through Sentinel is refused rather than half-applied.
* Redis Cluster is refused (``CLUSTER_UNSUPPORTED``): by URL here, and by ``refuse_cluster``
  for a redis:// URL whose server turns out to be cluster-enabled.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.retry as aioretry
import redis.asyncio.sentinel as aiosentinel
import redis.retry
import redis.sentinel
from redis.backoff import ExponentialBackoff
from redis.driver_info import DriverInfo

from agentbatch.core.errors import ConfigError
from agentbatch.core.redis_url import (
    CLUSTER_UNSUPPORTED,
    TLS_FILE_OPTIONS,
    SentinelURL,
    check_url,
    mask_url,
    parse_sentinel,
    split_sentinel,
    url_scheme,
)
from agentbatch.distributed.state.cancel_safe import CancelSafeSend
from agentbatch.distributed.state.hiredis_packing import HiredisPacking, connection_class

_CLIENT_OPTS = {
    "decode_responses": True,
    "socket_keepalive": True,
    "socket_connect_timeout": 5,
    "health_check_interval": 15,
    "retry_on_timeout": True,
    # what each new connection reports (CLIENT SETINFO); without it, redis-py 8.1 reads its
    # version from the package metadata for every connection, ~2.6 ms each (the email parser)
    "driver_info": DriverInfo(lib_version=redis.__version__),
}
_TCP_ONLY_OPTS = ("socket_keepalive", "socket_keepalive_options")

log = logging.getLogger(__name__)

def broker_ssl(url: str) -> dict[str, Any] | None:
    """Celery's ``broker_use_ssl`` for ``url``: verified TLS for rediss://, else None."""
    check_url(url)
    parts = urlsplit(url)
    if parts.scheme != "rediss":
        return None
    query = dict(parse_qsl(parts.query))
    options: dict[str, Any] = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_check_hostname": True}
    options.update({k: query[k] for k in TLS_FILE_OPTIONS if query.get(k)})
    return options


def broker_url(url: str) -> str:
    """``url`` as kombu's Redis transport reads it.

    unix:// becomes ``redis+socket://`` (db as ``virtual_host``); rediss:// loses its TLS
    query options, which ``broker_ssl`` hands to kombu instead; sentinel:// becomes kombu's
    ``sentinel://h1:p1/db;sentinel://h2:p2/db`` (the primary's name goes in
    ``broker_transport``)."""
    check_url(url)
    if url_scheme(url) == "sentinel":
        split = split_sentinel(url)
        assert split is not None  # check_url parsed it
        userinfo = f"{split[0]}@" if split[0] else ""
        db = parse_sentinel(url).db
        return ";".join(f"sentinel://{userinfo}{host}/{db}" for host in split[2])
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
             if k not in (*TLS_FILE_OPTIONS, "ssl_cert_reqs", "ssl_check_hostname")]
    if parts.scheme == "unix":
        query = [("virtual_host", v) if k == "db" else (k, v) for k, v in query]
        auth = parts.netloc.rpartition("@")[0]
        netloc = f"{auth}@" if auth else ""
        encoded = urlencode(query)
        return f"redis+socket://{netloc}{parts.path}" + (f"?{encoded}" if encoded else "")
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), ""))


def broker_transport(url: str) -> dict[str, Any]:
    """What kombu's transport options must add for ``url``: the primary's name for
    sentinel:// (kombu's ``master_name``), nothing otherwise."""
    check_url(url)
    if url_scheme(url) == "sentinel":
        return {"master_name": parse_sentinel(url).service}
    return {}


def broker_client_url(kombu_url: str, transport_options: dict[str, Any] | None) -> str:
    """The agentbatch URL back from Celery's ``broker_url`` and transport options, for
    clients that share the broker's connection settings (``distributed/workers/dispatch.py``)."""
    master = (transport_options or {}).get("master_name")
    if not kombu_url.startswith("sentinel://") or master is None:
        return kombu_url
    alts = [split_sentinel(alt) for alt in kombu_url.split(";")]
    if any(alt is None for alt in alts):
        raise ConfigError(f"{mask_url(kombu_url)} is not a broker URL agentbatch wrote")
    userinfo, _, _, db, _ = alts[0]  # type: ignore[misc]
    hosts = ",".join(alt[1] for alt in alts)  # type: ignore[index]
    auth = f"{userinfo}@" if userinfo else ""
    return f"sentinel://{auth}{hosts}/{master}?db={db or 0}"


def _options(url: str, overrides: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    check_url(url)
    scheme = url_scheme(url)
    options = {**_CLIENT_OPTS, **defaults, **overrides}
    if scheme == "unix":  # a unix socket has no TCP keepalive; redis-py rejects the option
        for name in _TCP_ONLY_OPTS:
            options.pop(name, None)
    if scheme == "rediss":
        options["ssl_cert_reqs"] = "required"
        options["ssl_check_hostname"] = True
    return options


_SENTINEL_QUERY_TIMEOUT_S = 2.0  # a sentinel answers "who is the primary" from memory
# While Sentinel fails over, a command is retried (the primary re-asked of the sentinels at
# each reconnect) instead of failing its task: backoff 0.1, 0.2, 0.4, 0.8, then 1 s. With no
# primary at all, a sync client's command gives up after about 30 s and an async client's
# (whose connect retries on its own too) after about 60 s (redis-py 8.1, measured with
# tests/support/sentinel.py); a failover within that fails no task (docs/failover.md).
FAILOVER_RETRIES = 32
_FAILOVER_BACKOFF = {"cap": 1.0, "base": 0.05}


class _AsyncReconnecting(CancelSafeSend, HiredisPacking,
                         aiosentinel.SentinelManagedConnection):
    """Asks the sentinels for the primary on every (re)connect. redis-py 8.1's asyncio
    connection asks only when the pool hands it out; a command's own retries reconnect to
    the address it had, so through a whole failover they hammer the dead primary and the
    command fails (the sync client re-asks; tests/integration/test_redis_sentinel.py)."""

    async def _connect(self) -> None:
        if self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super()._connect()


def _sentinel_args(url: str, options: dict[str, Any], retry_class: type[Any]
                   ) -> tuple[SentinelURL, dict[str, Any], dict[str, Any]]:
    """(parsed URL, the primary's client options, the sentinels' client options)."""
    parsed = parse_sentinel(url)
    primary = {**options, "db": parsed.db,
               "retry": retry_class(ExponentialBackoff(**_FAILOVER_BACKOFF), FAILOVER_RETRIES)}
    if parsed.username:
        primary["username"] = parsed.username
    if parsed.password is not None:
        primary["password"] = parsed.password
    sentinels: dict[str, Any] = {k: options[k]
                                 for k in ("socket_connect_timeout", "socket_keepalive")
                                 if k in options}
    sentinels["socket_timeout"] = _SENTINEL_QUERY_TIMEOUT_S
    return parsed, primary, sentinels


def async_client(url: str, **overrides: Any) -> aioredis.Redis:
    options = _options(url, overrides, {"max_connections": 256})
    if url_scheme(url) == "sentinel":
        parsed, primary, sentinels = _sentinel_args(url, options, aioretry.Retry)
        manager = aiosentinel.Sentinel(list(parsed.hosts), sentinel_kwargs=sentinels)
        return manager.master_for(parsed.service, connection_class=_AsyncReconnecting,
                                  **primary)
    packing = connection_class(url_scheme(url))
    if packing is not None:
        options.setdefault("connection_class", packing)
    return aioredis.from_url(url, **options)


def sync_client(url: str, **overrides: Any) -> redis.Redis:
    options = _options(url, overrides, {})
    if url_scheme(url) == "sentinel":
        parsed, primary, sentinels = _sentinel_args(url, options, redis.retry.Retry)
        manager = redis.sentinel.Sentinel(list(parsed.hosts), sentinel_kwargs=sentinels)
        return manager.master_for(parsed.service, **primary)
    return redis.from_url(url, **options)


def refuse_cluster(client: redis.Redis) -> None:
    """Raise ``ConfigError(CLUSTER_UNSUPPORTED)`` when ``client``'s server runs in cluster
    mode: a redis:// URL can point at a cluster node, and agentbatch's scripts would then
    fail with CROSSSLOT on their first multi-key step instead of saying why."""
    try:
        info = client.info("cluster")
    except redis.exceptions.NoPermissionError:  # a user without +info: Cluster fails later
        log.info("cannot check that Redis is not a cluster: this user may not run INFO")
        return
    if str(info.get("cluster_enabled", 0)) == "1":
        raise ConfigError(CLUSTER_UNSUPPORTED)


def refuse_cluster_at(url: str) -> None:
    """``refuse_cluster`` for a process about to start (a worker): a Redis that cannot be
    reached yet is not an error here, since the worker waits for it (and is logged); one that
    refuses the credentials is (``ConfigError``, the URL masked)."""
    client = sync_client(url, socket_timeout=5)
    try:
        refuse_cluster(client)
    except redis.AuthenticationError as exc:  # retrying cannot fix a wrong password: stop
        raise ConfigError(f"Redis at {mask_url(url)} refused the credentials: {exc}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        log.warning("cannot reach Redis at %s to check it is not a cluster (%s: %s); "
                    "starting anyway", mask_url(url), type(exc).__name__, exc)
    finally:
        client.close()
