"""The live progress view of a batch: rich in a terminal, tqdm's notebook bar in Jupyter.

``run_batch(progress=...)`` and ``agentbatch watch`` both draw ``handle.progress()``
snapshots (``progress.py``) and nothing else; with ``prices`` they show the spend and the
projected cost to complete (``cost_line``), without them nothing about cost. On by default
only where a person looks at it: stderr a terminal, or a Jupyter kernel, and no ``CI``
environment variable (CI logs would fill with redraws).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from rich.console import Console, Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from agentbatch.core.errors import BatchSpecError
from agentbatch.turnloop.handle import BatchHandle
from agentbatch.turnloop.progress import BatchProgress

log = logging.getLogger(__name__)
T = TypeVar("T")
REFRESH_S = 0.5


def in_jupyter() -> bool:
    """True inside a Jupyter kernel (Colab's included), not a terminal IPython. Imports
    nothing: a kernel has already imported ipykernel."""
    zmqshell = sys.modules.get("ipykernel.zmqshell")
    ipython = sys.modules.get("IPython")
    if zmqshell is None or ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:
        return False
    return isinstance(shell, zmqshell.ZMQInteractiveShell)


def resolve(progress: object) -> bool:
    """Whether to show the bar for ``run_batch(progress=...)``; None decides from where it
    runs. An explicit True is obeyed even in CI."""
    if progress is not None and not isinstance(progress, bool):
        raise BatchSpecError(f"progress must be True, False or None, got {progress!r}")
    if progress is not None:
        return progress
    if os.environ.get("CI"):
        return False
    return in_jupyter() or sys.stderr.isatty()


def _stderr_console() -> Console:
    return Console(stderr=True)


def _rate(p: BatchProgress) -> str:
    if p.throughput is None:
        return "- agents/s"
    eta = "" if p.eta_s is None or p.finished else f", ETA {_seconds(p.eta_s)}"
    return f"{p.throughput:.2f} agents/s{eta}"


def _seconds(s: float) -> str:
    minutes, sec = divmod(int(s), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{sec:02d}" if hours else f"{minutes}:{sec:02d}"


def counts_line(p: BatchProgress) -> str:
    """done, failed by kind, running, awaiting tools: the bar's text and tqdm's postfix."""
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(p.failed_by_kind.items()))
    failed = f"{p.failed} failed" + (f" ({kinds})" if kinds else "")
    return (f"{p.done} done, {failed}, {p.running} running, "
            f"{p.awaiting_tools} awaiting tools")


def cost_line(p: BatchProgress) -> str | None:
    """The spend so far and the projected cost to complete; None when the batch has no
    ``prices`` (then nothing about cost is shown). The projection is unknown ("-") until a
    reply has been paid for; ``budget_warning`` follows when the projection passes the cap."""
    if p.cost_usd is None:
        return None
    projected = "-" if p.projected_cost_usd is None else f"${p.projected_cost_usd:,.4f}"
    line = f"cost: ${p.cost_usd:,.4f} spent, {projected} projected to complete"
    return line + (f"; {p.budget_warning}" if p.budget_warning else "")


def render(p: BatchProgress, *, detail: bool = False) -> RenderableType:
    """The view of one snapshot; ``detail`` adds what ``agentbatch watch`` shows."""
    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=max(p.total, 1), completed=p.completed, width=40),
                Text(f"{p.completed}/{p.total}"))
    head = Text(f"batch {p.batch_id} [{p.engine}]  {_seconds(p.elapsed_s)}  {_rate(p)}")
    parts: list[RenderableType] = [head, bar, Text(counts_line(p))]
    if (cost := cost_line(p)) is not None:
        parts.append(Text(cost))
    if detail:
        parts.append(Text(f"{p.queued} queued, {p.recovering} recovering"))
        if p.tokens is not None:
            hit = p.tokens.cache_hit_rate
            parts.append(Text(
                f"tokens: {p.tokens.prompt:,} prompt, {p.tokens.cached:,} cached, "
                f"{p.tokens.completion:,} completion; cache hit "
                f"{'-' if hit is None else f'{hit:.0%}'}"
                + (" (finished agents)" if p.engine == "distributed" else "")))
        if p.slowest:
            slow = ", ".join(f"#{a.index} {a.seconds:.0f}s" for a in p.slowest)
            parts.append(Text(f"slowest running: {slow}"))
    return Group(*parts)


class _Poller:
    """The latest snapshot, read at most every REFRESH_S; a failed read keeps the last one
    (a Redis hiccup must not break the caller's wait)."""

    def __init__(self, handle: BatchHandle, detail: bool) -> None:
        self.handle, self.detail = handle, detail
        self.last: BatchProgress | None = None

    def poll(self) -> BatchProgress | None:
        try:
            self.last = self.handle.progress()
        except Exception as exc:
            log.debug("progress snapshot failed: %s", exc)
        return self.last

    def __rich__(self) -> RenderableType:
        p = self.poll()
        return Text("starting…") if p is None else render(p, detail=self.detail)


def show_while(handle: BatchHandle, wait: Callable[[], T], *,
               console: Console | None = None) -> T:
    """Run ``wait()`` (e.g. ``handle.wait``) with the live view drawn; the final counts
    stay on screen."""
    if console is None and in_jupyter():
        bar = _notebook_bar(handle)
        if bar is not None:
            with bar:
                return wait()
    from rich.live import Live

    poller = _Poller(handle, detail=False)
    with Live(poller, console=console or _stderr_console(),
              refresh_per_second=1 / REFRESH_S, transient=False):
        return wait()


def _notebook_bar(handle: BatchHandle) -> contextlib.AbstractContextManager[None] | None:
    """tqdm's notebook bar, updated from a thread; None without tqdm (or ipywidgets)."""
    try:
        from tqdm.notebook import tqdm
    except ImportError:
        return None
    return _tqdm_updates(handle, tqdm)


@contextlib.contextmanager
def _tqdm_updates(handle: BatchHandle, tqdm: Any) -> Iterator[None]:
    poller = _Poller(handle, detail=False)
    bar = tqdm(total=handle.total, desc=f"batch {handle.batch_id}", unit="agent")
    stop = threading.Event()

    def update() -> None:
        p = poller.poll()
        if p is not None:
            bar.n = p.completed
            cost = cost_line(p)
            bar.set_postfix_str(f"[{p.engine}] {counts_line(p)}; {_rate(p)}"
                                + (f"; {cost}" if cost else ""), refresh=False)
            bar.refresh()

    def loop() -> None:
        while not stop.wait(REFRESH_S):
            update()

    thread = threading.Thread(target=loop, daemon=True, name="agentbatch-progress")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
        update()
        bar.close()
