"""Where the distributed engine's worker CPU goes per task: py-spy on every worker process,
then yappi inside one inference worker, on bench_distributed's workload.

    python -m benchmarks.profile_fleet --agents 1000 \\
        --json benchmarks/results/profile_fleet.json

Two batches on one throwaway redis-server and simulator, each on a fresh fleet (4 inference
+ 2 tool worker processes, 16 threads each, by default):

1. py-spy ``record --nonblocking --format raw`` attached to every worker from the moment the
   fleet is ready until the batch has ended (then SIGINT). Only non-idle samples are counted:
   py-spy leaves idle threads out unless given ``--idle``, and calls a thread idle when its
   ``/proc/<tid>/stat`` state is not R (blocked on a socket, a lock or the GIL). A thread
   woken at a blocking call and still waiting for a core is R, though: on a loaded 2-core
   machine many samples sit on ``epoll``/lock waits, so they are counted apart (the
   ``blocking_calls``) and the CPU per task is spread over the others (``owners_running``).
   Without native stacks (they need the process paused) time in C code counts for the
   Python frame that called it: hiredis's reader for redis-py's ``_parsers/hiredis.py``,
   pydantic_core for pydantic, ``_json`` for ``json``.
2. yappi (CPU clock, every thread, the asyncio loop's included, builtins on) in the first
   inference worker only, through ``benchmarks/yappi_worker.py``, its stats cleared when
   the fleet is ready and written when the batch ends; the rest of the fleet unprofiled.
   ``--no-yappi`` skips this batch.

Both cost CPU on this 2-core machine: py-spy reads each of a worker's ~20 threads through
/proc on every sample (about 0.4 of a core per worker at 200 Hz, so six of them fall behind
and sample as fast as they can), and yappi about doubles its worker's CPU. The shares are
the thing measured; wall times are not comparable with bench_distributed's. The first
batch on a fresh fleet pays the workers' lazy imports (owner "imports (one-time)").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agentbatch.sim.config import SimConfig
from agentbatch.sim.process import SimProcess
from benchmarks.bench_distributed import ROUNDS, cpu_seconds, fleet_arguments, run_agentbatch
from benchmarks.machine import REPO, machine_info, utc_now, write_json
from tests.support.redis_server import RedisServer
from tests.support.workers import WorkerProcess

AGENTBATCH_PARTS = ("core", "turnloop", "distributed", "backends", "toolpool", "metrics")
STDLIB_IO = ("threading", "selectors", "socket", "ssl")
LIBRARIES = {"celery": "celery", "kombu": "kombu", "billiard": "billiard", "redis": "redis-py",
             "hiredis": "hiredis", "aiohttp": "aiohttp", "pydantic": "pydantic",
             "pydantic_core": "pydantic", "json": "json", "asyncio": "asyncio",
             **dict.fromkeys(STDLIB_IO, "stdlib io")}
NO_AGENTBATCH = "(no agentbatch frame)"
IMPORTS = "imports (one-time)"
# Frames that sit on a blocking call (epoll_wait, a lock's acquire): py-spy counts a thread
# there as active when its /proc state is R, i.e. in the syscall or woken and waiting for a
# core, which on a loaded 2-core machine is mostly waiting, not CPU.
BLOCKING_CALLS = {
    "selectors": ("EpollSelector.select", "PollSelector.select", "SelectSelector.select",
                  "DefaultSelector.select"),
    "kombu.utils.eventio": ("_epoll.poll", "_poll.poll", "_select.poll"),
    "threading": ("Condition.wait", "Event.wait", "Semaphore.acquire", "Thread.join",
                  "Thread._wait_for_tstate_lock", "Barrier.wait"),
    "queue": ("Queue.get",),
}
ENTRY_MODULES = ("agentbatch.cli", "agentbatch.__main__")  # the process's entry, not a cause
TOP = 25


# --- frames, modules and owners --------------------------------------------------------------

def _roots() -> list[str]:
    """Directories a module path is relative to, longest first (site-packages before REPO,
    which holds the venv)."""
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths |= set(site.getsitepackages()) | {str(REPO)}
    paths |= {os.path.join(p, "lib-dynload") for p in list(paths)}
    return sorted((os.path.realpath(p) for p in paths), key=len, reverse=True)


ROOTS = _roots()


def module_of(filename: str) -> tuple[str, str]:
    """(dotted module, path relative to its sys.path root) of a code file."""
    if filename.startswith("<frozen ") and filename.endswith(">"):
        return filename[8:-1], filename
    for root in ROOTS:
        if filename.startswith(root + os.sep):
            rel = filename[len(root) + 1:]
            mod = rel.removesuffix(".py").replace(os.sep, ".").removesuffix(".__init__")
            return mod, rel
    return "?", filename


def owner_of(module: str, function: str = "") -> str | None:
    """The owner of a frame's code, None for a module outside the list."""
    parts = module.split(".")
    if parts[0] == "agentbatch":
        if len(parts) > 2 and parts[1] == "distributed" and parts[2] in ("state", "workers"):
            return f"agentbatch.distributed.{parts[2]}"  # the Redis side and the Celery side
        return (f"agentbatch.{parts[1]}" if len(parts) > 1 and parts[1] in AGENTBATCH_PARTS
                else "agentbatch (other)")
    if module == "redis._parsers.hiredis" or function == "HiredisRespSerializer.pack":
        return "hiredis"  # redis-py's glue around hiredis's C reader and packer
    return LIBRARIES.get(parts[0])


def self_owner(module: str, function: str) -> str:
    """The owner of a function's own time (yappi's tsub, py-spy's innermost frame)."""
    if module.startswith("importlib") or function == "<module>":
        return IMPORTS
    return owner_of(module, function) or "other"


Frame = tuple[str, str, str]  # module, short path, function
Stack = tuple[str, list[Frame], int]  # thread name, frames outermost first, samples

_FRAME = re.compile(r"^(?P<name>.*?) \((?P<file>.*?)(?::\d+)?\)$")
_THREAD = re.compile(r"^thread \(\w+\)(?:: (?P<name>.*))?$")


def parse_raw(text: str) -> list[Stack]:
    """py-spy ``--format raw --threads --full-filenames`` collapsed stacks."""
    out: list[Stack] = []
    for line in text.split("\n"):  # not splitlines: a torn frame may hold \x0c or \x1c
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        parts = stack.split(";")
        thread = ""
        m = _THREAD.match(parts[0])
        if m:
            thread, parts = m.group("name") or "?", parts[1:]
        frames = []
        for part in parts:
            f = _FRAME.match(part)
            name, filename = (f.group("name"), f.group("file")) if f else (part, "")
            module, short = module_of(filename) if filename else ("?", "?")
            frames.append((module, short, name))
        out.append((thread, frames, int(count)))
    return out


def thread_role(name: str) -> str:
    if name == "agentbatch-loop":
        return "asyncio loop (agentbatch-loop)"
    if name.startswith("ThreadPoolExecutor"):
        return "task threads (Celery pool)"
    if name == "MainThread":
        return "main thread (Celery consumer)"
    return re.sub(r"[-_]?\d+$", "", name) or "?"


def _label(frame: Frame) -> str:
    return f"{frame[1]}:{frame[2]}"


def _shares(counts: Counter[str], total: int, ms_per_share: float,
            top: int | None = None, key: str = "owner") -> list[dict[str, Any]]:
    return [{key: k, "share": round(v / total, 4),
             "cpu_ms_per_task": round(v / total * ms_per_share, 4)}
            for k, v in counts.most_common(top)]


def analyze(stacks: Iterable[Stack]) -> dict[str, Counter[str]]:
    """Sample counts by owner and by function, for one kind of worker."""
    c: dict[str, Counter[str]] = {k: Counter() for k in (
        "owners", "owners_running", "owners_self", "innermost_package", "innermost",
        "blocking", "agentbatch", "agentbatch_running", "threads")}
    for thread, frames, n in stacks:
        c["threads"][thread_role(thread)] += n
        if not frames:
            for k in ("owners", "owners_running", "owners_self", "innermost_package",
                      "innermost"):
                c[k]["(no Python frame)"] += n
            c["agentbatch"][NO_AGENTBATCH] += n
            c["agentbatch_running"][NO_AGENTBATCH] += n
            continue
        inner = frames[-1]
        # owner: the innermost frame whose package is on the list (a logging call made by
        # celery is celery's), and any import in progress (a lazy import on first use) is
        # "imports"; owners_self: the innermost frame's own package or "other"
        if any(f[0].startswith("importlib") for f in frames):
            owner = IMPORTS
        else:
            owner = next((o for f in reversed(frames) if (o := owner_of(f[0], f[2]))), "other")
        c["owners"][owner] += n
        blocking = inner[2] in BLOCKING_CALLS.get(inner[0], ())
        if blocking:
            c["blocking"][_label(inner)] += n
        else:
            c["owners_running"][owner] += n
        c["owners_self"][self_owner(inner[0], inner[2])] += n
        c["innermost_package"][inner[0].split(".")[0]] += n
        c["innermost"][_label(inner)] += n
        # the agentbatch function responsible: the innermost agentbatch frame that is neither
        # a module body being imported nor the process entry (cli.worker under Celery's loop)
        ours = next((f for f in reversed(frames) if f[0].startswith("agentbatch.")
                     and f[0] not in ENTRY_MODULES and f[2] != "<module>"), None)
        c["agentbatch"][_label(ours) if ours else NO_AGENTBATCH] += n
        if not blocking:
            c["agentbatch_running"][_label(ours) if ours else NO_AGENTBATCH] += n
    return c


def kind_report(counts: dict[str, Counter[str]], cpu_s: float, tasks: int,
                unit: str) -> dict[str, Any]:
    total = sum(counts["owners"].values())
    if not total:
        return {"samples": 0, "cpu_s": round(cpu_s, 3), "tasks": tasks, "task_unit": unit}
    ms = cpu_s * 1000 / tasks if tasks else 0.0
    ab = Counter({k: v for k, v in counts["agentbatch"].items() if k != NO_AGENTBATCH})
    blocked = sum(counts["blocking"].values())
    return {
        "samples": total, "cpu_s": round(cpu_s, 3), "tasks": tasks, "task_unit": unit,
        "cpu_ms_per_task": round(ms, 3),
        # every non-idle sample, the innermost listed frame's owner
        "owners": _shares(counts["owners"], total, ms),
        # the samples at a blocking call left out (BLOCKING_CALLS): the better CPU estimate
        # when the machine is loaded; its cpu_ms_per_task spreads the CPU over these only
        "blocking_call_share": round(blocked / total, 4),
        "blocking_calls": _shares(counts["blocking"], total, ms, 10, "function"),
        "owners_running": _shares(counts["owners_running"], total - blocked, ms)
        if total > blocked else [],
        "owners_self": _shares(counts["owners_self"], total, ms),
        "innermost_packages": _shares(counts["innermost_package"], total, ms, 15, "package"),
        "threads": _shares(counts["threads"], total, ms, None, "thread"),
        "agentbatch_on_stack_share": round(sum(ab.values()) / total, 4),
        "top_innermost": _shares(counts["innermost"], total, ms, TOP, "function"),
        "top_agentbatch": _shares(ab, total, ms, TOP, "function"),
    }


def combined_agentbatch(per_kind: dict[str, tuple[Counter[str], float]], tasks: int,
                        top: int = TOP) -> list[dict[str, Any]]:
    """Agentbatch functions (innermost agentbatch frame, inclusive) across both kinds, ranked
    by estimated CPU: each kind's sample share times that kind's CPU seconds (the samples
    without an agentbatch frame count in the shares)."""
    cpu: Counter[str] = Counter()
    shares: dict[str, dict[str, float]] = {}
    for kind, (counts, kind_cpu) in per_kind.items():
        total = sum(counts.values())
        for fn, n in counts.items():
            if fn == NO_AGENTBATCH or not total:
                continue
            cpu[fn] += n / total * kind_cpu
            shares.setdefault(fn, {})[kind] = round(n / total, 4)
    return [{"function": fn, **{f"{k}_share": shares[fn].get(k, 0.0) for k in per_kind},
             "cpu_ms_per_task": round(s * 1000 / tasks, 4) if tasks else None}
            for fn, s in cpu.most_common(top)]


# --- py-spy --------------------------------------------------------------------------------

def pyspy_binary() -> str:
    here = Path(sys.executable).parent / "py-spy"
    found = str(here) if here.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy is not installed: pip install py-spy (or pip install -e .[dev])")
    return found


class Spy:
    """``py-spy record`` attached to one worker process."""

    def __init__(self, worker: WorkerProcess, out_dir: Path, rate: int) -> None:
        assert worker.proc is not None
        self.worker, self.pid = worker, worker.proc.pid
        self.raw = out_dir / f"{worker.name}-{worker.queues}-{self.pid}.txt"
        self.log_path = out_dir / f"{worker.name}-{worker.queues}-{self.pid}.log"
        self.cmd = [pyspy_binary(), "record", "--pid", str(self.pid), "--rate", str(rate),
                    "--format", "raw", "--output", str(self.raw), "--nonblocking",
                    "--threads", "--full-filenames", "--hideprogress"]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        self.cpu_s = 0.0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_attached(self, deadline: float) -> None:
        while "Sampling process" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"py-spy did not attach to worker {self.worker.name} "
                                   f"(pid {self.pid}): {self.log()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> dict[str, Any]:
        if self.proc.poll() is None:
            self.cpu_s = cpu_seconds(self.proc.pid)
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        log = self.log()
        m = re.search(r"Samples: (\d+) Errors: (\d+)", log)
        return {"samples_reported": int(m.group(1)) if m else None,
                "errors": int(m.group(2)) if m else None,
                "late_warnings": log.count("behind in sampling"),
                "py_spy_cpu_s": round(self.cpu_s, 2), "raw": str(self.raw),
                "exit": self.proc.returncode}


class FleetCpu:
    """Per-process CPU seconds over the measured window (``on_ready`` to ``on_done``)."""

    def __init__(self) -> None:
        self.before: dict[int, float] = {}
        self.rows: list[dict[str, Any]] = []

    def start(self, fleet: list[WorkerProcess]) -> None:
        self.before = {p.proc.pid: cpu_seconds(p.proc.pid) for p in fleet if p.proc}

    def stop(self, fleet: list[WorkerProcess]) -> None:
        self.rows = [{"name": p.name, "queue": p.queues, "pid": p.proc.pid,
                      "cpu_s": round(cpu_seconds(p.proc.pid) - self.before[p.proc.pid], 3)}
                     for p in fleet if p.proc]

    def by_queue(self, queue: str) -> float:
        return sum(r["cpu_s"] for r in self.rows if r["queue"] == queue)


def pyspy_run(server: RedisServer, backend: str, args: argparse.Namespace,
              out_dir: Path) -> dict[str, Any]:
    spies: list[Spy] = []
    cpu = FleetCpu()
    stopped: dict[int, dict[str, Any]] = {}

    def on_ready(fleet: list[WorkerProcess]) -> None:
        spies.extend(Spy(p, out_dir, args.rate) for p in fleet)
        deadline = time.monotonic() + 60
        for s in spies:
            s.wait_attached(deadline)
        cpu.start(fleet)

    def on_done(fleet: list[WorkerProcess]) -> None:
        cpu.stop(fleet)
        for s in spies:
            stopped[s.pid] = s.stop()

    try:
        run = run_agentbatch(server, backend, args.agents, args.inference_workers,
                             args.tool_workers, args.concurrency, on_ready=on_ready,
                             on_done=on_done)
    finally:
        for s in spies:  # a failed batch: never leave a py-spy behind
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait(10)
    processes, counts, kind_cpu = [], {}, {}
    for queue in ("inference", "tools"):
        stacks: list[Stack] = []
        for s in (s for s in spies if s.worker.queues == queue):
            mine = parse_raw(s.raw.read_text()) if s.raw.exists() else []
            stacks += mine
            row = next(r for r in cpu.rows if r["pid"] == s.pid)
            processes.append({**row, "samples": sum(n for _, _, n in mine),
                              **stopped.get(s.pid, {})})
        counts[queue] = analyze(stacks)
        kind_cpu[queue] = cpu.by_queue(queue)
    units = {"inference": ("model turn", run["model_turns"]),
             "tools": ("tool call", run["tool_calls"])}
    return {
        "py_spy_version": subprocess.run([pyspy_binary(), "--version"], capture_output=True,
                                         text=True).stdout.strip(),
        "rate_hz": args.rate,
        "command": shlex.join(["py-spy", *spies[0].cmd[1:]]) if spies else None,
        "idle_samples": "excluded: py-spy's default without --idle. A thread is sampled "
                        "when its /proc/<tid>/stat state is R (running or runnable); "
                        "py-spy's fallback heuristic (innermost function named 'wait' in "
                        "threading.py or 'select' in selectors.py) misses Python 3.11's "
                        "qualified names (Condition.wait, EpollSelector.select), so threads "
                        "woken at a blocking call and waiting for a core are sampled too: "
                        "see blocking_call_share and owners_running",
        "run": run,
        "processes": processes,
        "py_spy_cpu_s": round(sum(p.get("py_spy_cpu_s", 0.0) for p in processes), 2),
        "late_warnings": sum(p.get("late_warnings", 0) for p in processes),
        **{queue: kind_report(counts[queue], kind_cpu[queue], tasks, unit)
           for queue, (unit, tasks) in units.items()},
        "all_workers": {
            "cpu_s": round(sum(kind_cpu.values()), 3), "tasks": run["tasks"],
            "cpu_ms_per_task": round(sum(kind_cpu.values()) * 1000 / run["tasks"], 3),
            "owners": combined_owners(counts, kind_cpu, run["tasks"]),
            # both from the samples not at a blocking call
            "top_agentbatch": combined_agentbatch(
                {k: (counts[k]["agentbatch_running"], kind_cpu[k]) for k in counts},
                run["tasks"]),
        },
    }


def combined_owners(counts: dict[str, dict[str, Counter[str]]], kind_cpu: dict[str, float],
                    tasks: int) -> list[dict[str, Any]]:
    """Owner CPU across both kinds (each kind's share of its samples not at a blocking call,
    times its CPU), per task."""
    cpu: Counter[str] = Counter()
    for kind, c in counts.items():
        total = sum(c["owners_running"].values())
        for owner, n in (c["owners_running"].items() if total else ()):
            cpu[owner] += n / total * kind_cpu[kind]
    whole = sum(cpu.values())
    return [{"owner": o, "share": round(s / whole, 4),
             "cpu_ms_per_task": round(s * 1000 / tasks, 4) if tasks else None}
            for o, s in cpu.most_common()]


# --- yappi ---------------------------------------------------------------------------------

class YappiWorker(WorkerProcess):
    """A WorkerProcess whose command runs under ``benchmarks.yappi_worker`` (the same
    ``agentbatch.cli worker`` argv as ``WorkerProcess.start``)."""

    def __init__(self, *args: Any, out: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.out = out

    def start(self, wait: bool = True) -> YappiWorker:
        cmd = [sys.executable, "-m", "benchmarks.yappi_worker", str(self.out),
               "worker", "--queues", self.queues, "--concurrency", str(self.concurrency),
               "--redis-url", self.redis_url, "--pool", self.pool,
               "--hostname", f"{self.name}-{os.getpid()}@%h", "--loglevel", self.loglevel]
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd=REPO)
        if wait:
            self.wait_ready()
        return self


def _short_row(r: dict[str, Any]) -> dict[str, Any]:
    module, short = module_of(r["module"]) if not r["builtin"] else (r["module"], r["module"])
    return {"module": short, "name": r["name"], "ncall": r["ncall"], "tsub": r["tsub"],
            "tsub_c": r["tsub_c"], "ttot": r["ttot"],
            "owner": "C builtin" if r["builtin"] else self_owner(module, r["name"])}


def yappi_run(server: RedisServer, backend: str, args: argparse.Namespace,
              out_dir: Path) -> dict[str, Any]:
    from benchmarks.yappi_worker import STARTED_SUFFIX, WINDOW_END, WINDOW_START

    out = out_dir / "yappi-b0.json"
    started = Path(str(out) + STARTED_SUFFIX)
    out.unlink(missing_ok=True)
    started.unlink(missing_ok=True)
    cpu = FleetCpu()
    profiled: list[WorkerProcess] = []

    def make_worker(url: str, **kwargs: Any) -> WorkerProcess:
        if kwargs["name"] == "b0":  # the first inference worker
            profiled.append(YappiWorker(url, out=out, **kwargs))
            return profiled[0]
        return WorkerProcess(url, **kwargs)

    def wait_for(path: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def on_ready(fleet: list[WorkerProcess]) -> None:
        # the stats so far (imports, Celery's start) are dropped: yappi measures the batch
        assert profiled[0].proc is not None
        profiled[0].proc.send_signal(WINDOW_START)
        wait_for(started, 30)
        cpu.start(fleet)

    def on_done(fleet: list[WorkerProcess]) -> None:
        cpu.stop(fleet)
        assert profiled[0].proc is not None
        profiled[0].proc.send_signal(WINDOW_END)  # stop yappi, write the stats
        wait_for(out, 300)

    run = run_agentbatch(server, backend, args.agents, args.inference_workers,
                         args.tool_workers, args.concurrency, make_worker=make_worker,
                         on_ready=on_ready, on_done=on_done)
    if not out.exists():
        return {"run": run, "processes": cpu.rows,
                "error": f"the yappi worker wrote no stats to {out}"}
    data = json.loads(out.read_text())
    by_owner: Counter[str] = Counter()
    for key, t in data["tsub_c_by_function"].items():
        path, _, name = key.partition("\t")
        by_owner[self_owner(module_of(path)[0], name)] += t
    total = sum(by_owner.values())
    threads: Counter[str] = Counter()
    for t in data["threads"]:
        threads[thread_role(t["name"])] += t["ttot"]
    profiled = next((r for r in cpu.rows if r["name"] == "b0"), {})
    others = [r["cpu_s"] for r in cpu.rows if r["queue"] == "inference" and r["name"] != "b0"]
    return {
        "run": run, "processes": cpu.rows, "stats_file": str(out),
        "profiled_worker": {"name": "b0", "queue": "inference", "cpu_s": profiled.get("cpu_s"),
                            "other_inference_workers_mean_cpu_s":
                                round(sum(others) / len(others), 3) if others else None},
        "clock": data["clock"], "window": data["window"], "functions": data["functions"],
        "profiled_cpu_s": round(total, 3),
        # self time by owner, C callees folded into the Python function calling them (no
        # walk up the stack here: a logging call by celery is "other"; imports: module
        # bodies and importlib)
        "owners_self": [{"owner": o, "share": round(v / total, 4), "cpu_s": round(v, 3)}
                        for o, v in by_owner.most_common()] if total else [],
        "threads": [{"thread": k, "cpu_s": round(v, 3)} for k, v in threads.most_common()],
        "top_tsub": [_short_row(r) for r in data["top_tsub"]],
        "top_ttot": [_short_row(r) for r in data["top_ttot"]],
    }


# --- main ----------------------------------------------------------------------------------

def summary(report: dict[str, Any]) -> str:
    from benchmarks.report import render_profile_fleet

    lines = [render_profile_fleet(report)]
    y = report.get("yappi")
    if y and "top_tsub" in y:
        lines += ["", f"yappi, inference worker b0 ({y['clock']} clock), top 10 by tsub:"]
        lines += [f"  {r['tsub']:8.3f} s tsub  {r['ttot']:8.3f} s ttot  {r['ncall']:>8} calls  "
                  f"{r['module']}:{r['name']}" for r in y["top_tsub"][:10]]
        lines += ["yappi owners (self time, C callees folded in): " + ", ".join(
            f"{o['owner']} {100 * o['share']:.1f}%" for o in y["owners_self"][:10])]
    elif y:
        lines += ["", f"yappi: {y.get('error')}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    fleet_arguments(p)
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--no-yappi", action="store_true", help="skip the yappi batch")
    p.add_argument("--profiles-dir", default=None,
                   help="where py-spy's raw stacks and yappi's stats go (default: a new "
                        "/tmp/agentbatch-profile-* directory)")
    p.add_argument("--json", default="benchmarks/results/profile_fleet.json")
    args = p.parse_args(argv)
    if args.inference_workers < 1:
        p.error("--inference-workers must be at least 1")
    command = shlex.join(["python", "-m", "benchmarks.profile_fleet",
                          *(sys.argv[1:] if argv is None else argv)])
    out_dir = Path(args.profiles_dir or tempfile.mkdtemp(prefix="agentbatch-profile-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    pyspy_binary()  # fail before starting anything
    os.environ["TEST_TOOL_SLEEP_S"] = str(args.tool_s)
    machine = machine_info()
    started = time.perf_counter()
    server = RedisServer().start()
    sim = SimProcess(SimConfig(fixed_ms=args.fixed_ms)).start()
    backend = "sim://" + sim.url.split("://", 1)[1]
    try:
        spy = pyspy_run(server, backend, args, out_dir)
        yap = None if args.no_yappi else yappi_run(server, backend, args, out_dir)
    finally:
        sim.stop()
        server.cleanup()
    report = {
        "benchmark": "profile_fleet",
        "when": utc_now(),
        "machine": machine,
        "command": command,
        "total_s": round(time.perf_counter() - started, 1),
        "workload": {"agents": args.agents, "tool_rounds": ROUNDS, "fixed_ms": args.fixed_ms,
                     "tool_s": args.tool_s, "inference_workers": args.inference_workers,
                     "tool_workers": args.tool_workers, "threads_per_worker": args.concurrency},
        "tasks": spy["run"]["tasks"],
        "profiles_dir": str(out_dir),
        "py_spy": spy,
        "yappi": yap,
    }
    write_json(Path(args.json), report)
    print(summary(report))
    print(f"\nwrote {args.json}; raw stacks and yappi stats in {out_dir}")
    ok = spy["run"]["ok"] == args.agents and (yap is None or "error" not in yap)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
