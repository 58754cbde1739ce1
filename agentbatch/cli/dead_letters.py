"""`agentbatch dead-letters`: list and drop queue messages the workers refused as malformed."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from agentbatch.cli.text import inert

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Queue messages workers refused as malformed (see `ls`, `drop`).")
console = Console()

if TYPE_CHECKING:
    import redis

_REDIS_URL = typer.Option(None, envvar="AGENTBATCH_REDIS_URL", help="Redis URL (the broker).")


def _client(redis_url: str | None) -> redis.Redis:
    if not redis_url:
        raise typer.BadParameter("--redis-url (or AGENTBATCH_REDIS_URL) is required")
    from agentbatch.distributed.state.connection import sync_client

    # the one place URLs become clients (sentinel://, TLS); raw bytes as the letters hold
    return sync_client(redis_url, decode_responses=False)


@contextlib.contextmanager
def _redis_errors() -> Iterator[None]:
    """Redis down or refusing, or a URL it cannot use: one line naming the option, exit 2."""
    import redis

    from agentbatch.core.errors import AgentBatchError

    try:
        yield
    except (redis.RedisError, AgentBatchError) as exc:
        typer.echo(f"error: --redis-url (AGENTBATCH_REDIS_URL): {type(exc).__name__}: {exc}",
                   err=True)
        raise typer.Exit(2) from None


def _when(at: object) -> str:
    """A letter's time as UTC text, or ``?`` when it is not a usable timestamp."""
    if not isinstance(at, int | float) or isinstance(at, bool):
        return "?"
    try:
        return dt.datetime.fromtimestamp(at, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):  # 1e300, nan, inf
        return "?"


@app.command("ls")
def ls(redis_url: str = _REDIS_URL,
       limit: int = typer.Option(100, min=1, help="Show at most this many (newest first)."),
       as_json: bool = typer.Option(False, "--json", help="One JSON record per line.")) -> None:
    """List dead letters, newest first."""
    from agentbatch.distributed.workers import dead_letters

    with _redis_errors():
        client = _client(redis_url)
        letters = dead_letters.list_letters(client, limit)
        total = client.llen(dead_letters.DEAD_LETTERS)
    if as_json:
        for letter in letters:
            typer.echo(json.dumps(letter))
        return
    table = Table(title=f"{total} dead letter(s) in {dead_letters.DEAD_LETTERS}")
    for column in ("id", "when (UTC)", "queue", "bytes", "reason", "raw (start)"):
        table.add_column(column, overflow="fold")
    for letter in letters:  # anyone who can write Redis wrote these: every cell is inert
        table.add_row(inert(letter.get("id")), _when(letter.get("at")), inert(letter.get("queue")),
                      inert(letter.get("size", "?")), inert(letter.get("reason")),
                      inert(str(letter.get("raw", ""))[:80]))
    console.print(table)


@app.command("drop")
def drop(letter_id: str = typer.Argument(None, metavar="ID", help="The letter to drop."),
         drop_all: bool = typer.Option(False, "--all", help="Drop every dead letter."),
         redis_url: str = _REDIS_URL) -> None:
    """Drop one dead letter by id, or all of them with --all."""
    from agentbatch.distributed.workers import dead_letters

    if drop_all == bool(letter_id):
        raise typer.BadParameter("give exactly one of ID or --all")
    with _redis_errors():
        client = _client(redis_url)
        if drop_all:
            typer.echo(f"dropped {dead_letters.drop_all(client)} dead letter(s)")
            return
        dropped = dead_letters.drop(client, letter_id)
    if not dropped:
        typer.echo(f"no dead letter with id {letter_id!r}", err=True)
        raise typer.Exit(1)
    typer.echo(f"dropped {letter_id}")
