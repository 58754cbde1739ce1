"""`agentbatch watch BATCH_ID`: a distributed batch's live progress, from any machine that
reaches its Redis, until it finishes.

On a terminal it redraws the view every ``--interval``. When stdout is not a terminal (a
log, a pipe) it prints a plain line each time the finished count changes, at most once per
``--interval``, then the final counts. A batch with ``prices`` also shows its spend so far and
the projected cost to complete (``progress_display.cost_line``); one without shows nothing
about cost. Exit status: 0 once the batch has finished, 2 for an
unknown or expired batch, 1 when Redis fails or ``--timeout`` passes, 130 on Ctrl-C.
"""

from __future__ import annotations

import time

import typer
from rich.console import Console
from rich.markup import escape

from agentbatch.cli.batches import _fail
from agentbatch.turnloop.handle import BatchHandle
from agentbatch.turnloop.progress import BatchProgress

_REDIS_URL = typer.Option(None, envvar="AGENTBATCH_REDIS_URL", help="Redis URL (the broker).")


def watch(batch_id: str = typer.Argument(..., metavar="BATCH_ID"),
          redis_url: str = _REDIS_URL,
          interval: float = typer.Option(1.0, "--interval", min=0.1,
                                         help="Seconds between snapshots."),
          timeout: float = typer.Option(None, "--timeout", min=0.0,
                                        help="Give up after this many seconds (exit 1); "
                                             "default: until the batch finishes.")) -> None:
    """Show a distributed batch's live progress until it finishes, then its final counts."""
    import redis

    from agentbatch import get_batch
    from agentbatch.core.errors import AgentBatchError, BatchExpired, BatchSpecError
    if not redis_url:
        raise typer.BadParameter("--redis-url (or AGENTBATCH_REDIS_URL) is required")
    try:
        handle = get_batch(batch_id, redis_url=redis_url)
    except (BatchSpecError, BatchExpired) as exc:  # unknown, or gone after its retention
        raise _fail(str(exc), 2) from None
    except (AgentBatchError, redis.RedisError) as exc:
        raise _fail(f"watching batch {batch_id} failed: {exc}") from None
    console = Console()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        if console.is_terminal:
            final = _live(handle, console, interval, deadline)
        else:
            final = _plain(handle, interval, deadline)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except BatchExpired as exc:
        raise _fail(str(exc), 2) from None
    except (AgentBatchError, redis.RedisError) as exc:
        raise _fail(f"watching batch {batch_id} failed: {exc}") from None
    finally:
        handle.close()
    if final is None:
        raise _fail(f"batch {batch_id} had not finished after --timeout {timeout}s")
    console.print(escape(_final(final)), highlight=False, soft_wrap=True)


def _live(handle: BatchHandle, console: Console, interval: float, deadline: float | None
          ) -> BatchProgress | None:
    from rich.live import Live

    from agentbatch.turnloop.progress_display import render

    snap = handle.progress()
    with Live(render(snap, detail=True), console=console, auto_refresh=False) as live:
        while not snap.finished:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(interval)
            snap = handle.progress()
            live.update(render(snap, detail=True), refresh=True)
    return snap


def _plain(handle: BatchHandle, interval: float, deadline: float | None
           ) -> BatchProgress | None:
    from agentbatch.turnloop.progress_display import cost_line

    snap = handle.progress()
    shown = -1
    while not snap.finished:
        if snap.completed != shown:
            shown = snap.completed
            cost = cost_line(snap)
            print(snap.summary() + (f"; {cost}" if cost else ""), flush=True)
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(interval)
        snap = handle.progress()
    return snap


def _final(p: BatchProgress) -> str:
    """The final counts: what a script reading the output greps for."""
    from agentbatch.turnloop.progress_display import cost_line

    kinds = ", ".join(f"{k} {n}" for k, n in sorted(p.failed_by_kind.items()))
    lines = [f"batch {p.batch_id} finished [{p.engine}]: {p.done} done, {p.failed} failed"
             + (f" ({kinds})" if kinds else "") + f", total {p.total}, "
             f"elapsed {p.elapsed_s:.1f}s"]
    if p.tokens is not None:
        hit = p.tokens.cache_hit_rate
        lines.append(f"tokens: {p.tokens.prompt} prompt, {p.tokens.cached} cached, "
                     f"{p.tokens.completion} completion; cache hit "
                     f"{'-' if hit is None else f'{hit:.0%}'}")
    if (cost := cost_line(p)) is not None:
        lines.append(cost)
    return "\n".join(lines)
