"""`agentbatch ls` and `agentbatch rm`: the distributed batches Redis holds, and removing one
before its retention (``AGENTBATCH_RETENTION_S``) runs out."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agentbatch.cli.text import inert

if TYPE_CHECKING:
    import redis

console = Console()
_REDIS_URL = typer.Option(None, envvar="AGENTBATCH_REDIS_URL", help="Redis URL (the broker).")


def _client(redis_url: str | None) -> redis.Redis:
    if not redis_url:
        raise typer.BadParameter("--redis-url (or AGENTBATCH_REDIS_URL) is required")
    from agentbatch.distributed.state.connection import sync_client

    return sync_client(redis_url)


def _fail(message: str, code: int = 1) -> typer.Exit:
    Console(stderr=True).print(f"[red]error:[/red] {escape(message)}", highlight=False,
                               soft_wrap=True)
    return typer.Exit(code)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _size(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def ls(redis_url: str = _REDIS_URL,
       as_json: bool = typer.Option(False, "--json", help="One JSON record per line."),
       no_sizes: bool = typer.Option(False, "--no-sizes",
                                     help="Skip MEMORY USAGE (one command per key).")) -> None:
    """List the batches in Redis, oldest first: status, progress, age, size, expiry."""
    import redis

    from agentbatch.core.errors import AgentBatchError
    from agentbatch.distributed.state.retention import list_batches

    try:
        infos = list_batches(_client(redis_url), sizes=not no_sizes)
    except (redis.RedisError, AgentBatchError) as exc:
        raise _fail(f"listing batches failed: {exc}") from None
    now = time.time()
    if as_json:
        for info in infos:
            record = info.as_dict()
            record["age_s"] = round(now - info.created_at, 3) if info.created_at else None
            typer.echo(json.dumps(record))
        return
    table = Table(title=f"{len(infos)} batch(es)")
    # the id is what a user copies into `status` or `rm`: never wrapped nor cut with "…"
    # (the other columns give way first; fold, whole characters, only past that)
    table.add_column("batch", no_wrap=True, overflow="fold",
                     min_width=max((len(i.batch_id) for i in infos), default=5))
    table.add_column("status")
    for column in ("delivered", "age", "keys", "size", "expires in"):
        table.add_column(column, justify="right")
    for info in infos:
        age = now - info.created_at if info.created_at else None
        progress = "?" if info.status == "damaged" else f"{info.delivered}/{info.total}"
        table.add_row(inert(info.batch_id), inert(info.status), progress, _age(age),
                      str(info.keys), "-" if no_sizes else _size(info.bytes),
                      _age(info.ttl_s) if info.ttl_s is not None else "never (running)")
    console.print(table)


def rm(batch_id: str = typer.Argument(..., metavar="BATCH_ID"),
       force: bool = typer.Option(False, "--force",
                                  help="Delete a batch still running: cancel it first."),
       redis_url: str = _REDIS_URL) -> None:
    """Delete a batch's keys from Redis now (a running batch needs --force).

    --force cancels the batch first. Reading the batch afterwards raises BatchExpired.
    """
    import redis

    from agentbatch.core.errors import AgentBatchError
    from agentbatch.distributed.state.retention import BatchRunning, delete_batch

    try:
        removed = delete_batch(_client(redis_url), batch_id, force=force)
    except BatchRunning as exc:
        raise _fail(f"{exc}: agentbatch rm --force {batch_id}", 2) from None
    except AgentBatchError as exc:
        raise _fail(str(exc)) from None
    except redis.RedisError as exc:
        raise _fail(f"deleting batch {batch_id} failed: {exc}") from None
    typer.echo(f"deleted batch {batch_id} ({removed} key(s))")


def register(app: typer.Typer) -> None:
    """Add ``ls`` and ``rm`` as top-level commands of ``agentbatch``."""
    app.command("ls")(ls)
    app.command("rm")(rm)
