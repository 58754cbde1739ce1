"""`agentbatch flower`: Flower, the Celery dashboard, closed by default.

``celery -A agentbatch.distributed.workers flower`` listens on every interface with no auth,
and watches ``redis://127.0.0.1:6379`` when no URL is set. Flower shows every task's args
(batch ids, agent indexes) and can revoke tasks and shut workers down, so this command:

* binds 127.0.0.1 unless ``--address`` is given;
* needs ``--basic-auth user:password`` or ``--auth`` (Flower's OAuth e-mail pattern), unless
  ``--no-auth`` says plainly that the UI is to be open;
* needs a broker URL (``--redis-url`` or ``AGENTBATCH_REDIS_URL``) and reads it as the
  workers do (verified ``rediss://`` included).

Flower runs in this process, so neither the Redis URL nor the credentials are put on any
command line; give them as ``AGENTBATCH_REDIS_URL`` and ``FLOWER_BASIC_AUTH`` to keep them
out of this process's own argv too.
"""

from __future__ import annotations

import errno
import socket
import sys

import typer

LOOPBACK = "127.0.0.1"
TASKS_COLUMNS = "name,args,state,received,runtime,worker"
# Flower keeps every task it has seen in memory (its own cap is 100,000). 10,000 is about one
# 1,000-agent batch of turns and tool calls: enough to follow the running batch, bounded.
MAX_TASKS = 10_000
# kombu's consumers restore timed-out unacked messages of the whole fleet back to the queues.
# Flower consumes only events and replies (never unacked tasks) and, under the Redis ACL's
# flower user (deploy/redis-users.acl), may not write to the task queues: its bookkeeping
# lives under keys of its own, and the workers restore their own messages.
FLOWER_UNACKED_KEYS = {"unacked_key": "flower.unacked",
                       "unacked_index_key": "flower.unacked_index",
                       "unacked_mutex_key": "flower.unacked_mutex"}


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _check_basic_auth(value: str) -> None:
    """``user:password[,user:password...]``, none of them empty (no secret is echoed)."""
    for i, pair in enumerate(value.split(","), 1):
        user, sep, password = pair.partition(":")
        if not sep or not user.strip() or not password:
            raise _fail(f"--basic-auth: credential {i} must be user:password with neither "
                        "part empty (comma-separate several)")


def _check_port_free(address: str, port: int) -> None:
    """Bind and release ``address:port`` as Flower (tornado) would, so a port in use is one
    line naming it rather than a traceback ending in ``[Errno 98]``."""
    try:
        infos = socket.getaddrinfo(address or None, port, socket.AF_UNSPEC,
                                   socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise _fail(f"--address: cannot resolve {address!r}: {exc}") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                raise _port_error(address, port, exc) from None


def _port_error(address: str, port: int, exc: OSError) -> typer.Exit:
    if exc.errno == errno.EADDRINUSE:
        return _fail(f"--port: port {port} on {address} is already in use (another Flower "
                     "or service listens there); choose another with --port")
    return _fail(f"--port/--address: cannot listen on {address}:{port}: {exc.strerror}")


def flower(
    redis_url: str = typer.Option(None, envvar="AGENTBATCH_REDIS_URL", show_envvar=True,
                                  help="Redis URL of the broker (required; prefer the "
                                       "environment variable, it keeps the password out of "
                                       "argv)."),
    port: int = typer.Option(5555, min=1, max=65535, help="HTTP port."),
    address: str = typer.Option(LOOPBACK, help="Interface to listen on; 0.0.0.0 exposes "
                                               "Flower to the network."),
    basic_auth: str = typer.Option(None, envvar="FLOWER_BASIC_AUTH", show_envvar=True,
                                   help="user:password (comma-separate several)."),
    auth: str = typer.Option(None, envvar="FLOWER_AUTH", show_envvar=True,
                             help="Flower's OAuth e-mail pattern, e.g. '.*@example.com' "
                                  "(configure the provider with FLOWER_AUTH_PROVIDER and "
                                  "FLOWER_OAUTH2_*)."),
    no_auth: bool = typer.Option(False, "--no-auth",
                                 help="Run with no authentication (anyone who can reach the "
                                      "port can read every task and control the workers)."),
    tasks_columns: str = typer.Option(TASKS_COLUMNS, envvar="FLOWER_TASKS_COLUMNS",
                                      help="Task list columns (args names batch and agent)."),
    max_tasks: int = typer.Option(MAX_TASKS, min=1, envvar="FLOWER_MAX_TASKS",
                                  show_envvar=True,
                                  help="Tasks Flower keeps in memory (the oldest are dropped)."),
) -> None:
    """Run Flower (the Celery dashboard) on 127.0.0.1 with authentication."""
    if not redis_url:
        raise _fail("--redis-url (or AGENTBATCH_REDIS_URL) is required: Flower would "
                    "otherwise watch redis://127.0.0.1:6379, which may not be your fleet")
    from agentbatch.core.errors import ConfigError
    from agentbatch.distributed.state.connection import check_url, mask_url

    try:
        check_url(redis_url)
    except ConfigError as exc:
        raise _fail(f"--redis-url: {exc}") from None
    if no_auth and (basic_auth or auth):
        raise _fail("--no-auth contradicts --basic-auth/--auth (or FLOWER_BASIC_AUTH/"
                    "FLOWER_AUTH in the environment): choose one")
    if not (no_auth or basic_auth or auth):
        raise _fail("Flower needs authentication: give --basic-auth user:password (or "
                    "FLOWER_BASIC_AUTH), or --auth with an e-mail pattern for OAuth; pass "
                    "--no-auth to run it open on purpose")
    if basic_auth:
        _check_basic_auth(basic_auth)
    if no_auth:
        where = "this machine" if address == LOOPBACK else f"anyone who can reach {address}"
        typer.echo(f"warning: Flower runs with no authentication; {where} can read every "
                   "task and control the workers", err=True)

    _check_port_free(address, port)

    try:  # importing the app reads AGENTBATCH_REDIS_URL even when --redis-url is given
        from agentbatch.distributed.workers import app as celery_app
        from agentbatch.distributed.workers.app import celery_config
    except ConfigError as exc:
        raise _fail(f"AGENTBATCH_REDIS_URL: {exc}") from None

    try:
        config = celery_config(redis_url)
    except ConfigError as exc:
        raise _fail(f"--redis-url: {exc}") from None
    config["broker_transport_options"] = {**config["broker_transport_options"],
                                          **FLOWER_UNACKED_KEYS}
    celery_app.conf.update(config)
    # Flower's own options: in-process, so no secret lands in a child's argv.
    argv = ["flower", f"--port={port}", f"--address={address}",
            f"--tasks_columns={tasks_columns}", f"--max_tasks={max_tasks}"]
    if basic_auth:
        argv.append(f"--basic_auth={basic_auth}")
    if auth:
        argv.append(f"--auth={auth}")
    typer.echo(f"Flower for {mask_url(redis_url)} on http://{address}:{port}", err=True)
    try:
        # (celery-types declares start() NoReturn; it returns the command's exit code)
        code: int | None = celery_app.start(argv)
    except OSError as exc:  # taken between the check above and Flower's own bind
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        raise _port_error(address, port, exc) from None
    sys.exit(code or 0)
