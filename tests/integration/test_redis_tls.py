"""Issue 8, item 9: rediss:// is verified TLS, for agentbatch's clients AND the Celery broker.

A TLS-only redis-server (``--port 0 --tls-port``) with a certificate signed by a CA made in
the test. A batch runs end to end over ``rediss://...?ssl_ca_certs=CA`` with real workers;
without the CA (or trusting another CA) both agentbatch's client and kombu's broker
connection refuse the server; ``ssl_cert_reqs=none`` is refused before anything connects.
Before the fix, Celery got a bare ``rediss://`` broker URL and kombu connected with
``CERT_NONE`` ("defaulting to insecure SSL behaviour").
"""

from __future__ import annotations

import logging
import ssl
import subprocess
import sys
from collections.abc import Iterator
from urllib.parse import quote

import pytest
import redis
from kombu.exceptions import OperationalError

from agentbatch import BatchSpecError, ConfigError, submit_batch
from agentbatch.distributed.state.connection import sync_client
from agentbatch.distributed.workers.app import (
    INFERENCE_QUEUE,
    PRIORITY_STEPS,
    celery_config,
    make_app,
)
from agentbatch.distributed.workers.envelope import queue_key
from tests.support.secure_redis import TlsRedisServer
from tests.support.tools import Answer, cached_lookup
from tests.support.workers import REPO, WorkerProcess

pytestmark = [pytest.mark.redis, pytest.mark.slow]

AGENTS = 12


@pytest.fixture(scope="module")
def tls_server() -> Iterator[TlsRedisServer]:
    import shutil

    if shutil.which("redis-server") is None or shutil.which("openssl") is None:
        pytest.skip("redis-server and the openssl CLI are needed (.ci/run installs them)")
    server = TlsRedisServer().start()
    yield server
    server.cleanup()


def _broker_refuses(url: str) -> BaseException:
    """Connect kombu exactly as a worker would (the app's own config); return the error."""
    app = make_app(url)
    with app.connection_for_write() as conn, pytest.raises(
            (OperationalError, redis.ConnectionError, ssl.SSLError)) as info:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0,
                               timeout=10)
        conn.default_channel.client.ping()
    return info.value


def test_the_submitter_enqueues_every_turn_over_verified_tls(tls_server, sim_url, caplog):
    """No worker runs: every first turn must be on the queue lists, put there by the
    submitter itself (before the fix it connected without the CA, failed, and left the
    turns to the workers' recovery sweep, minutes later with default settings)."""
    url = tls_server.url(ca=tls_server.ca)
    trusted = sync_client(url)
    trusted.flushdb()
    try:
        with caplog.at_level(logging.WARNING):
            handle = submit_batch("Agent {i}.", [{"i": i} for i in range(AGENTS)], model="m",
                                  backend=sim_url, redis_url=url, warm_prefix=False)
        assert not [r.getMessage() for r in caplog.records if "cut short" in r.getMessage()]
        queued = sum(trusted.llen(queue_key(INFERENCE_QUEUE, step)) for step in PRIORITY_STEPS)
        assert queued == AGENTS
        assert handle.status()["total"] == AGENTS
    finally:
        trusted.flushdb()


def test_batch_runs_end_to_end_over_verified_tls(tls_server, sim_url):
    url = tls_server.url(ca=tls_server.ca)
    workers = [WorkerProcess(url, name=f"tls{i}", concurrency=8) for i in range(2)]
    try:
        for w in workers:
            w.start(wait=False)
        for w in workers:
            w.wait_ready()
        task = 'Agent {i}.\n@sim tool cached_lookup {{"key": "k{m}"}}'
        handle = submit_batch(task, [{"i": i, "m": i % 3} for i in range(AGENTS)],
                              model="m", backend=sim_url, redis_url=url,
                              tools=[cached_lookup], output_schema=Answer)
        results = handle.wait(timeout=120)
        assert [r.index for r in results] == list(range(AGENTS))
        assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
        assert all(r.turns == 2 for r in results)  # a turn, a tool call, a turn: both queues
        # the server has no plaintext port at all, so every byte above went over TLS
        admin = sync_client(url)
        assert admin.config_get("port") == {"port": "0"}
        assert admin.config_get("tls-port") == {"tls-port": str(tls_server.port)}
        for w in workers:  # kombu did not fall back to unverified TLS
            assert "insecure SSL" not in w.log(), w.log()[-2000:]
    finally:
        for w in workers:
            w.stop(timeout=15)
            w.log_path.unlink(missing_ok=True)


def test_the_celery_broker_config_requires_a_verified_certificate(tls_server):
    for url in (tls_server.url(), tls_server.url(ca=tls_server.ca)):
        options = celery_config(url)["broker_use_ssl"]
        assert options["ssl_cert_reqs"] == ssl.CERT_REQUIRED, options
        assert "ssl_ca_certs" not in celery_config(url)["broker_url"]
    assert celery_config(tls_server.url(ca=tls_server.ca))["broker_use_ssl"]["ssl_ca_certs"] \
        == str(tls_server.ca)
    assert celery_config("redis://127.0.0.1:1/0")["broker_use_ssl"] is None


def test_kombu_connects_with_the_ca_and_refuses_an_untrusted_certificate(tls_server):
    app = make_app(tls_server.url(ca=tls_server.ca))
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=10)
        assert conn.default_channel.client.ping()
    # a bare rediss:// trusts only the system CAs, which never signed the test CA
    error = _broker_refuses(tls_server.url())
    assert "CERTIFICATE_VERIFY_FAILED" in repr(error) or "certificate verify" in str(error), \
        repr(error)
    # a CA that did not sign the server's certificate is no better
    error = _broker_refuses(tls_server.url(ca=tls_server.other_ca))
    assert "certificate verify" in str(error).lower() or "CERTIFICATE_VERIFY_FAILED" in \
        repr(error), repr(error)
    # the right CA, but an address the certificate does not name: the name is checked too
    error = _broker_refuses(tls_server.url(ca=tls_server.ca, host="127.0.0.2"))
    assert "mismatch" in str(error).lower(), repr(error)


def test_agentbatch_clients_refuse_an_untrusted_certificate(tls_server, sim_url):
    assert sync_client(tls_server.url(ca=tls_server.ca)).ping()
    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        sync_client(tls_server.url()).ping()
    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        sync_client(tls_server.url(ca=tls_server.other_ca)).ping()
    with pytest.raises(redis.ConnectionError, match=r"(?i)mismatch"):
        sync_client(tls_server.url(ca=tls_server.ca, host="127.0.0.2")).ping()
    # submitting over an unverifiable connection fails; nothing reaches the server
    trusted = sync_client(tls_server.url(ca=tls_server.ca))
    before = set(trusted.keys("*"))
    with pytest.raises(Exception, match=r"(?i)certificate verify failed"):
        submit_batch("Agent {i}.", [{"i": 0}], model="m", backend=sim_url,
                     redis_url=tls_server.url())
    assert set(trusted.keys("*")) == before


def test_unverified_tls_is_refused_by_name(tls_server, sim_url):
    insecure = tls_server.url(ca=tls_server.ca, query="ssl_cert_reqs=none")
    with pytest.raises(ConfigError, match="ssl_cert_reqs=none"):
        sync_client(insecure)
    with pytest.raises(ConfigError, match="ssl_cert_reqs=none"):
        celery_config(insecure)
    with pytest.raises(BatchSpecError, match=r"redis_url: .*ssl_cert_reqs=none"):
        submit_batch("Agent {i}.", [{"i": 0}], model="m", backend=sim_url, redis_url=insecure)
    # a worker asked for unverified TLS exits at once with the reason, before Celery starts
    out = subprocess.run([sys.executable, "-m", "agentbatch.cli", "worker", "--redis-url",
                          insecure], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin",
                              "AGENTBATCH_WORKER_IMPORTS": "tests.support"})
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert "ssl_cert_reqs=none" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_client_certificate_from_the_url_reaches_both_clients():
    """Mutual TLS: ``ssl_certfile``/``ssl_keyfile`` in the URL go to agentbatch's client and
    to kombu's broker connection; without them the server refuses the handshake."""
    server = TlsRedisServer(auth_clients=True).start()
    try:
        query = (f"ssl_certfile={quote(str(server.client_cert))}"
                 f"&ssl_keyfile={quote(str(server.client_key))}")
        url = server.url(ca=server.ca, query=query)
        assert sync_client(url).ping()
        options = celery_config(url)["broker_use_ssl"]
        assert options["ssl_certfile"] == str(server.client_cert)
        with make_app(url).connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=10)
            assert conn.default_channel.client.ping()
        with pytest.raises(redis.ConnectionError):
            sync_client(server.url(ca=server.ca)).ping()
        _broker_refuses(server.url(ca=server.ca))
    finally:
        server.cleanup()
