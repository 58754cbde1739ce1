"""Run ``agentbatch worker`` under yappi (CPU clock, every thread) and write its function and
thread stats as JSON.

    python -m benchmarks.yappi_worker OUT.json worker --queues inference ...

The arguments after OUT.json are ``python -m agentbatch.cli``'s. Signal WINDOW_START clears
the stats gathered so far (imports, Celery's start-up) and touches OUT.json.started;
WINDOW_END stops yappi and writes OUT.json. Without them the stats cover the whole process
and are written when it exits (SIGTERM: Celery's warm shutdown). Benchmark-only: profiling
code stays out of the ``agentbatch`` package.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import yappi

TOP = 40
WINDOW_START = signal.SIGRTMIN + 1  # Celery takes SIGUSR1 (and SIGUSR2 with CELERY_RDBSIG)
WINDOW_END = signal.SIGRTMIN + 2
STARTED_SUFFIX = ".started"
_window = {"started": False}


def _row(s: Any) -> dict[str, Any]:
    # C functions called from a Python function are profiled as its children (builtins=True)
    # and left out of its tsub: ``tsub_c`` adds them back, so time in json, hiredis or
    # pydantic_core counts for the Python function that called it
    c = 0.0 if s.builtin else sum(ch.tsub for ch in s.children if ch.builtin)
    return {"module": s.module, "name": s.name, "lineno": s.lineno, "builtin": s.builtin,
            "ncall": s.ncall, "tsub": round(s.tsub, 6), "tsub_c": round(s.tsub + c, 6),
            "ttot": round(s.ttot, 6)}


def start_window(path: str) -> None:
    yappi.clear_stats()
    _window["started"] = True
    Path(path + STARTED_SUFFIX).touch()


def dump(path: str) -> None:
    if not yappi.is_running():
        return  # written already
    yappi.stop()
    rows = [_row(s) for s in yappi.get_func_stats()]
    by_function: dict[str, float] = {}  # "path\tname": CPU with C callees folded in
    for r in rows:
        if not r["builtin"] and r["tsub_c"]:
            key = f"{r['module']}\t{r['name']}"
            by_function[key] = by_function.get(key, 0.0) + r["tsub_c"]
    threads = [{"name": t.name, "ttot": round(t.ttot, 6), "sched_count": t.sched_count}
               for t in yappi.get_thread_stats()]
    data = {"clock": yappi.get_clock_type(), "functions": len(rows),
            "window": "signalled" if _window["started"] else "whole process",
            "top_tsub": sorted(rows, key=lambda r: -r["tsub"])[:TOP],
            "top_ttot": sorted(rows, key=lambda r: -r["ttot"])[:TOP],
            "tsub_c_by_function": by_function,
            "builtin_tsub_total": round(sum(r["tsub"] for r in rows if r["builtin"]), 6),
            "threads": sorted(threads, key=lambda t: -t["ttot"])}
    Path(path + ".tmp").write_text(json.dumps(data))
    os.replace(path + ".tmp", path)  # whole or absent for whoever waits on it


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    yappi.set_clock_type("cpu")
    yappi.set_context_name_callback(lambda: threading.current_thread().name)
    signal.signal(WINDOW_START, lambda *_: start_window(out))
    signal.signal(WINDOW_END, lambda *_: dump(out))
    atexit.register(dump, out)  # also when the worker leaves through sys.exit
    yappi.start(builtins=True, profile_threads=True)
    sys.argv = ["agentbatch", *argv]
    from agentbatch.cli import main as cli_main

    try:
        cli_main()
    finally:
        dump(out)


if __name__ == "__main__":
    main()
