"""`agentbatch show BATCH_ID INDEX` and `agentbatch export BATCH_ID -o FILE`: one agent's
conversation, readable, and every result as JSON lines, while Redis retains the batch.

Everything printed from Redis (messages, tool arguments and outputs, the system prompt) is
made inert (``cli_text.visible``): a model or a tool can write escape sequences or rich
markup, and a terminal must show them, never act on them. Exit status: 0, or 2 for an
unknown or expired batch, an index it does not have, or a conversation that was not kept.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.text import Text

from agentbatch.cli.batches import _fail
from agentbatch.cli.text import visible

if TYPE_CHECKING:
    import redis

    from agentbatch.core.plan import BatchPlan

_REDIS_URL = typer.Option(None, envvar="AGENTBATCH_REDIS_URL", help="Redis URL (the broker).")
DEFAULT_MAX_CHARS = 2000
_ROLE_STYLE = {"system": "magenta", "user": "green", "assistant": "cyan", "tool": "yellow"}


def _open(batch_id: str, redis_url: str | None) -> tuple[redis.Redis, BatchPlan]:
    """The client and the batch's plan; exit 2 when the batch is unknown or expired."""
    import redis as redis_lib

    from agentbatch.core.errors import BatchSpecError
    from agentbatch.core.plan import BatchPlan
    from agentbatch.distributed.state.connection import mask_url, sync_client
    from agentbatch.distributed.state.keys import BatchKeys
    from agentbatch.distributed.state.retention import missing_error
    from agentbatch.turnloop.validate import check_batch_id

    if not redis_url:
        raise typer.BadParameter("--redis-url (or AGENTBATCH_REDIS_URL) is required")
    try:
        check_batch_id(batch_id)
    except BatchSpecError as exc:
        raise _fail(str(exc), 2) from None
    client = sync_client(redis_url)
    try:
        raw = client.get(BatchKeys(batch_id).plan)
        gone = missing_error(client, batch_id) if raw is None else None
    except redis_lib.RedisError as exc:
        raise _fail(f"reading batch {batch_id} failed: {exc}") from None
    if gone is not None:
        raise _fail(str(gone), 2)
    if raw is None:
        raise _fail(f"no batch {batch_id!r} in Redis at {mask_url(redis_url)}", 2)
    return client, BatchPlan.model_validate_json(raw)


def show(batch_id: str = typer.Argument(..., metavar="BATCH_ID"),
         index: int = typer.Argument(..., metavar="INDEX", help="The agent's input index."),
         redis_url: str = _REDIS_URL,
         full: bool = typer.Option(False, "--full", help="Print tool outputs whole."),
         max_chars: int = typer.Option(DEFAULT_MAX_CHARS, "--max-chars", min=1,
                                       help="Cut tool outputs and the system prompt to this "
                                            "many characters, marked (unless --full).")
         ) -> None:
    """Print one agent's conversation: roles, tool calls with their arguments, tool outputs.

    A running agent's so far; an ended one's when it was kept (keep_transcript=True, or it
    failed), until the batch's retention runs out. With ``prices``, its spend so far."""
    from agentbatch.core.pricing import agent_cost
    from agentbatch.distributed.state.keys import BatchKeys
    from agentbatch.distributed.state.transcripts import stored_agent

    client, plan = _open(batch_id, redis_url)
    try:
        if not 0 <= index < plan.total:
            raise _fail(f"batch {batch_id} has {plan.total} agents (0 to {plan.total - 1}): "
                        f"no agent {index}", 2)
        state, kept = stored_agent(client, BatchKeys(batch_id), index)
    finally:
        client.close()
    if state is None:
        raise _fail(f"batch {batch_id} holds no state for agent {index} (its keys expired "
                    "or were deleted)", 2)
    if not kept:
        raise _fail(f"agent {index} of batch {batch_id} ended {state.status.value} and its "
                    "conversation was not kept (submit with keep_transcript=True; failed "
                    "agents always keep theirs)", 2)
    limit = None if full else max_chars
    console = Console(highlight=False, soft_wrap=True)
    status = state.status.value + (f" ({state.error.kind}: {state.error.message})"
                                   if state.error else "")
    cost = agent_cost(state, plan.prices, plan.model)
    spent = "" if cost is None else f" · ${cost:,.4f} spent"  # nothing without prices
    console.print(Text(visible(f"batch {batch_id} · agent {index} · {status} · "
                               f"{state.turns} turns{spent}"), style="bold"))
    _block(console, "system (shared by every agent)", plan.system_message, limit)
    for message in state.messages:
        _message(console, message, limit)


def _cut(text: str, limit: int | None) -> str:
    if limit is None or len(text) <= limit:
        return text
    return f"{text[:limit]}\n[... {len(text) - limit} more chars; --full prints them]"


def _content(value: Any) -> str:
    """A message's content as text: a string, the text of its parts, or its JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        return "\n".join(str(p.get("text", json.dumps(p))) for p in value)
    return json.dumps(value, ensure_ascii=False)


def _block(console: Console, title: str, body: str, limit: int | None) -> None:
    role = title.split(" ", 1)[0]
    console.print(Text(visible(f"── {title} "), style=f"bold {_ROLE_STYLE.get(role, '')}"))
    if body:
        console.print(Text(visible(_cut(body, limit))))


def _message(console: Console, message: dict[str, Any], limit: int | None) -> None:
    role = str(message.get("role", "?"))
    if role == "tool":
        title = f"tool output (call {message.get('tool_call_id', '?')})"
        _block(console, title, _content(message.get("content")), limit)
        return
    _block(console, role, _content(message.get("content")), None)
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments", "")
        try:
            args = json.dumps(json.loads(args), ensure_ascii=False, indent=2)
        except (TypeError, ValueError):
            args = str(args)
        console.print(Text(visible(f"→ tool call {fn.get('name', '?')} "
                                   f"(call {call.get('id', '?')})"), style="bold yellow"))
        console.print(Text(visible(args)))


def export(batch_id: str = typer.Argument(..., metavar="BATCH_ID"),
           output: str = typer.Option(..., "-o", "--output",
                                      help="The JSON-lines file to write ('-': stdout)."),
           redis_url: str = _REDIS_URL) -> None:
    """Write the batch's results as JSON lines, in input order, with each agent's messages
    when kept. A batch still running: the results delivered so far (said on stderr)."""
    import redis as redis_lib

    from agentbatch import get_batch
    from agentbatch.core.errors import AgentBatchError, BatchExpired, BatchSpecError

    client, plan = _open(batch_id, redis_url)  # unknown or expired: exit 2
    client.close()
    try:
        handle = get_batch(batch_id, redis_url=redis_url)
        try:
            results = handle.delivered()  # type: ignore[attr-defined]
            finished = handle.status().get("finished")
        finally:
            handle.close()
    except (BatchSpecError, BatchExpired) as exc:
        raise _fail(str(exc), 2) from None
    except (AgentBatchError, redis_lib.RedisError) as exc:
        raise _fail(f"exporting batch {batch_id} failed: {exc}") from None
    lines = [json.dumps(r.to_json_dict(), ensure_ascii=False) + "\n" for r in results]
    if output == "-":
        sys.stdout.writelines(lines)
    else:
        _write(Path(output), lines)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    where = "stdout" if output == "-" else output
    err.print(Text(visible(f"wrote {len(lines)} results of batch {batch_id} to {where}")))
    if not finished:
        err.print(Text(visible(f"batch {batch_id} is still running: {len(lines)} of "
                               f"{plan.total} agents have finished")))


def _write(path: Path, lines: list[str]) -> None:
    """Write all of ``lines`` or nothing: a temporary file beside ``path``, renamed over it."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        raise _fail(f"--output {path}: cannot write there ({exc.strerror})", 2) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(lines)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise _fail(f"--output {path}: cannot write there ({exc.strerror})", 2) from None


def register(app: typer.Typer) -> None:
    app.command("show")(show)
    app.command("export")(export)
