"""The distributed engine on this machine: wall, CPU and Redis commands per turn, vs the
Celery floor (the same task graph of no-op tasks) in the same run, that floor with each task
sleeping as long as the real one waits, and that floor with its model turns real HTTP calls
to the simulator (a Celery app that only calls the model, keeping no agent state).

    python -m benchmarks.bench_distributed --agents 1000 \\
        --json benchmarks/results/distributed_1000.json

Everything runs on this one 2-core machine: a throwaway redis-server, the simulator (its own
process), 4 inference-worker and 2 tool-worker processes, and this submitting process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from agentbatch import submit_batch
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.sim.config import SimConfig
from agentbatch.sim.process import SimProcess
from benchmarks.machine import machine_info, utc_now, write_json
from tests.chaos.client import TASK, inputs
from tests.support.redis_server import RedisServer
from tests.support.tools import Answer, cached_lookup, lookup
from tests.support.workers import REPO, WorkerProcess

ROUNDS = 3  # tool rounds per agent in tests.chaos.client.TASK
READY_S = 300.0  # six workers starting at once on a loaded 2-core machine: one took 24 s


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its reaped children (prefork pools)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))
    return ticks / os.sysconf("SC_CLK_TCK")


def commands(client: redis.Redis) -> int:
    return sum(v["calls"] for v in client.info("commandstats").values())


def commands_by_name(stats: dict[str, Any], tasks: int) -> dict[str, float]:
    """Redis commands per task by name, Lua-internal calls included (``INFO commandstats``):
    where the per-task count goes."""
    per_task = {name.removeprefix("cmdstat_").upper(): round(v["calls"] / tasks, 2)
                for name, v in stats.items()}
    return dict(sorted(per_task.items(), key=lambda kv: -kv[1]))


def batch_counters(client: redis.Redis, batch_id: str) -> dict[str, int]:
    """The batch's ``stat:*`` counters (re-sends by the sweep, duplicate claims dropped as
    stale or busy...): what recovery did during the measured run."""
    meta = client.hgetall(BatchKeys(batch_id).meta)
    return {k.decode().removeprefix("stat:"): int(v) for k, v in sorted(meta.items())
            if k.startswith(b"stat:")}


def start_fleet(url: str, n_inf: int, n_tools: int, concurrency: int,
                app: str | None = None,
                make_worker: Callable[..., WorkerProcess] = WorkerProcess) -> list[Any]:
    """The worker fleet, ready: ``n_inf`` inference then ``n_tools`` tool workers named
    ``b0``, ``b1``, ... (``make_worker`` builds each, like ``WorkerProcess``); with ``app``,
    plain Celery workers of that app instead (the floor)."""
    # the test tools' execution counters off: this measures agentbatch's cost per task, and
    # the floor's tasks count nothing either
    env = {"TEST_TOOL_SLEEP_S": os.environ.get("TEST_TOOL_SLEEP_S", "0.2"),
           "TEST_TOOL_COUNT": "0"}
    if app is None:
        procs: list[Any] = [make_worker(url, queues=q, concurrency=concurrency, name=f"b{i}",
                                        env=env).start(wait=False)
                            for i, q in enumerate(["inference"] * n_inf + ["tools"] * n_tools)]
        for p in procs:
            p.wait_ready(timeout=READY_S)
        return procs
    procs = []
    for i, q in enumerate(["inference"] * n_inf + ["tools"] * n_tools):
        log = open(f"/tmp/agentbatch-floor-{i}.log", "wb")  # noqa: SIM115 (lives with the proc)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", app, "worker", "-Q", q, "-P", "threads",
             "-c", str(concurrency), "--without-mingle", "--without-gossip", "-l", "INFO",
             "-n", f"floor{i}@%h"],
            env={**os.environ, "AGENTBATCH_REDIS_URL": url, "PYTHONPATH": str(REPO)},
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    deadline = time.monotonic() + READY_S
    for i in range(len(procs)):
        while b" ready." not in Path(f"/tmp/agentbatch-floor-{i}.log").read_bytes():
            if time.monotonic() > deadline:
                raise TimeoutError("floor workers did not start")
            time.sleep(0.1)
    return procs


def run_agentbatch(server: RedisServer, backend: str, agents: int, n_inf: int, n_tools: int,
                   concurrency: int, *,
                   make_worker: Callable[..., WorkerProcess] = WorkerProcess,
                   on_ready: Callable[[list[Any]], None] | None = None,
                   on_done: Callable[[list[Any]], None] | None = None) -> dict[str, Any]:
    """One batch on a fresh fleet. ``on_ready(fleet)`` runs once the fleet is ready, just
    before the measured window opens; ``on_done(fleet)`` as soon as the batch has ended and
    been measured, before the fleet stops (profilers attach and detach there)."""
    r = redis.from_url(server.url)
    r.flushdb()
    fleet = start_fleet(server.url, n_inf, n_tools, concurrency, make_worker=make_worker)
    try:
        if on_ready is not None:
            on_ready(fleet)
        r.config_resetstat()
        before = {p.proc.pid: cpu_seconds(p.proc.pid) for p in fleet}
        redis_before = cpu_seconds(server.proc.pid)
        me_before = time.process_time()
        started = time.perf_counter()
        handle = submit_batch(TASK, inputs(agents, faults=False), tools=[lookup, cached_lookup],
                              output_schema=Answer, model="sim-model", backend=backend,
                              redis_url=server.url, max_turns=5)
        submitted = time.perf_counter() - started
        results = handle.wait(timeout=1800)
        wall = time.perf_counter() - started
        worker_cpu = sum(cpu_seconds(p.proc.pid) - before[p.proc.pid] for p in fleet)
        redis_cpu = cpu_seconds(server.proc.pid) - redis_before
        client_cpu = time.process_time() - me_before
        cmds = commands(r)
        stats = r.info("commandstats")
        counters = batch_counters(r, handle.batch_id)
        if on_done is not None:
            on_done(fleet)
    finally:
        for p in fleet:
            p.stop(timeout=30)
    model_turns = sum(res.turns for res in results)
    tool_calls = sum(len(res.tool_calls) for res in results)
    tasks = model_turns + tool_calls
    return {
        "agents": agents, "ok": sum(res.ok for res in results), "wall_s": round(wall, 3),
        "submit_s": round(submitted, 3), "model_turns": model_turns, "tool_calls": tool_calls,
        "tasks": tasks,
        "cpu_s": {"workers": round(worker_cpu, 2), "redis": round(redis_cpu, 2),
                  "submitter": round(client_cpu, 2)},
        "cpu_ms_per_task_all_processes": round((worker_cpu + redis_cpu + client_cpu)
                                               / tasks * 1000, 3),
        "redis_commands_per_task_incl_lua": round(cmds / tasks, 2),
        "redis_commands_per_task_by_name": commands_by_name(stats, tasks),
        "batch_counters": counters,
        "loadavg_at_end": list(os.getloadavg()),
    }


def run_floor(server: RedisServer, agents: int, n_inf: int, n_tools: int,
              concurrency: int, waits: tuple[float, ...] = (),
              model_url: str | None = None) -> dict[str, Any]:
    from agentbatch.distributed.workers.dispatch import publish
    from benchmarks.celery_floor import DONE_KEY, app, step_message

    r = redis.from_url(server.url)
    r.flushdb()
    fleet = start_fleet(server.url, n_inf, n_tools, concurrency, app="benchmarks.celery_floor")
    try:
        steps = 2 * ROUNDS + 1
        app.conf.broker_url = server.url
        r.config_resetstat()
        before = {p.pid: cpu_seconds(p.pid) for p in fleet}
        redis_before = cpu_seconds(server.proc.pid)
        me_before = time.process_time()
        started = time.perf_counter()
        publish(app, [step_message(a, steps, waits, model_url) for a in range(agents)])
        deadline = time.monotonic() + max(600.0, agents * steps * 0.02)
        checked = 0.0
        while int(r.get(DONE_KEY) or 0) < agents:
            if time.monotonic() - checked > 2:  # a worker that discards the tasks: say so
                checked = time.monotonic()
                for i in range(len(fleet)):
                    if b"Received unregistered task" in Path(
                            f"/tmp/agentbatch-floor-{i}.log").read_bytes():
                        raise RuntimeError(
                            f"floor worker {i} discards the floor's tasks as unregistered "
                            f"(see /tmp/agentbatch-floor-{i}.log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Celery floor finished {r.get(DONE_KEY) or 0} of "
                                   f"{agents} agents before its deadline")
            time.sleep(0.05)
        wall = time.perf_counter() - started
        worker_cpu = sum(cpu_seconds(p.pid) - before[p.pid] for p in fleet)
        redis_cpu = cpu_seconds(server.proc.pid) - redis_before
        client_cpu = time.process_time() - me_before
        cmds = commands(r)
        stats = r.info("commandstats")
    finally:
        for p in fleet:
            p.terminate()
            p.wait(30)
    tasks = agents * steps
    # The same measures as ``run_agentbatch``: what Celery alone costs per task on this
    # machine, the part of each per-task target that agentbatch cannot remove.
    return {"agents": agents, "tasks": tasks, "waits_s": list(waits),
            "model_calls": "chat completions from the simulator" if model_url else None,
            "wall_s": round(wall, 3),
            "cpu_s": {"workers": round(worker_cpu, 2), "redis": round(redis_cpu, 2),
                      "submitter": round(client_cpu, 2)},
            "cpu_ms_per_task_all_processes": round((worker_cpu + redis_cpu + client_cpu)
                                                   / tasks * 1000, 3),
            "redis_commands_per_task_incl_lua": round(cmds / tasks, 2),
            "redis_commands_per_task_by_name": commands_by_name(stats, tasks)}


def workload_waits(turn_s: float, tool_s: float) -> tuple[float, ...]:
    """Per step (indexed by steps remaining, as ``celery_floor.step`` counts them), how long
    the real work waits: each model turn the simulator's latency, the two ``lookup`` rounds
    the tool's sleep; the ``cached_lookup`` round is a cache hit for all but 20 of the
    agents (``tests/chaos/client.py``), so it waits nothing here."""
    waits = [0.0] * (2 * ROUNDS + 2)
    for remaining in range(1, 2 * ROUNDS + 2):
        if remaining % 2 == 1:
            waits[remaining] = turn_s
    waits[2 * ROUNDS] = waits[2] = tool_s  # rounds 1 and 3 (remaining 6 and 2)
    return tuple(waits)


def client_commands_per_task(server: RedisServer, backend: str, concurrency: int) -> dict:
    """Count client round trips (not Lua-internal calls) with MONITOR on a small batch."""
    import threading

    r = redis.from_url(server.url)
    r.flushdb()
    fleet = start_fleet(server.url, 1, 1, concurrency)
    seen: list[tuple[str, str]] = []
    stop = threading.Event()

    def watch() -> None:
        client = redis.from_url(server.url, socket_timeout=1.0)
        with client.monitor() as monitor:
            while not stop.is_set():
                try:
                    cmd = monitor.next_command()
                except redis.TimeoutError:
                    continue
                seen.append((cmd["client_type"], cmd["command"].split(" ", 1)[0].upper()))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        time.sleep(1.0)
        seen.clear()
        results = submit_batch(TASK, inputs(50, faults=False), tools=[lookup, cached_lookup],
                               output_schema=Answer, model="sim-model", backend=backend,
                               redis_url=server.url, max_turns=5).wait(timeout=300)
        time.sleep(1.0)
        stop.set()
        watcher.join(5)
    finally:
        for p in fleet:
            p.stop(timeout=30)
    tasks = sum(res.turns + len(res.tool_calls) for res in results)
    client = [name for kind, name in seen if kind != "lua"]
    by_cmd: dict[str, int] = {}
    for name in client:
        by_cmd[name] = by_cmd.get(name, 0) + 1
    return {"tasks": tasks, "window_s": "batch of 50 agents, 2 workers, idle polling included",
            "client_commands_per_task": round(len(client) / tasks, 2),
            "lua_internal_per_task": round((len(seen) - len(client)) / tasks, 2),
            "client_commands_by_name": dict(sorted(by_cmd.items(), key=lambda kv: -kv[1]))}


def fleet_arguments(p: argparse.ArgumentParser) -> None:
    """The workload and fleet options this benchmark shares with ``profile_fleet``."""
    p.add_argument("--agents", type=int, default=1000)
    p.add_argument("--inference-workers", type=int, default=4)
    p.add_argument("--tool-workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--fixed-ms", type=float, default=60.0)
    p.add_argument("--tool-s", type=float, default=0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    fleet_arguments(p)
    p.add_argument("--json", default=None,
                   help="results file (default benchmarks/results/distributed_<agents>.json)")
    args = p.parse_args(argv)
    args.json = args.json or f"benchmarks/results/distributed_{args.agents}.json"
    os.environ["TEST_TOOL_SLEEP_S"] = str(args.tool_s)
    server = RedisServer().start()
    sim = SimProcess(SimConfig(fixed_ms=args.fixed_ms)).start()
    backend = "sim://" + sim.url.split("://", 1)[1]
    try:
        monitor = client_commands_per_task(server, backend, args.concurrency)
        ours = run_agentbatch(server, backend, args.agents, args.inference_workers,
                              args.tool_workers, args.concurrency)
        try:
            floor = run_floor(server, args.agents, args.inference_workers, args.tool_workers,
                              args.concurrency)
        except (RuntimeError, TimeoutError) as exc:  # keep the agentbatch numbers, say why
            floor = {"agents": args.agents, "error": str(exc)}
        try:
            floor_waits = run_floor(server, args.agents, args.inference_workers,
                                    args.tool_workers, args.concurrency,
                                    workload_waits(args.fixed_ms / 1000, args.tool_s))
        except (RuntimeError, TimeoutError) as exc:
            floor_waits = {"agents": args.agents, "error": str(exc)}
        try:  # the same, its model turns real HTTP calls to the simulator instead of sleeps
            floor_calls = run_floor(server, args.agents, args.inference_workers,
                                    args.tool_workers, args.concurrency,
                                    workload_waits(args.fixed_ms / 1000, args.tool_s),
                                    model_url=sim.url)
        except (RuntimeError, TimeoutError) as exc:
            floor_calls = {"agents": args.agents, "error": str(exc)}
    finally:
        sim.stop()
        server.cleanup()
    critical = (ROUNDS + 1) * args.fixed_ms / 1000 + ROUNDS * args.tool_s
    report = {
        "benchmark": "distributed",
        "when": utc_now(),
        "machine": machine_info(),
        "workload": {"agents": args.agents, "tool_rounds": ROUNDS, "fixed_ms": args.fixed_ms,
                     "tool_s": args.tool_s, "inference_workers": args.inference_workers,
                     "tool_workers": args.tool_workers, "threads_per_worker": args.concurrency,
                     "critical_path_s": round(critical, 3)},
        "agentbatch": ours,
        "celery_floor": floor,
        "celery_floor_with_waits": floor_waits,
        "celery_floor_with_model_calls": floor_calls,
        "redis_round_trips": monitor,
        "ratios": {
            "wall_vs_celery_floor": (round(ours["wall_s"] / floor["wall_s"], 3)
                                     if "wall_s" in floor else None),
            "wall_vs_celery_floor_with_waits": (
                round(ours["wall_s"] / floor_waits["wall_s"], 3)
                if "wall_s" in floor_waits else None),
            # Against a Celery app making the same model calls and keeping no agent state:
            # what of the gap to the floor with waits is the HTTP call itself.
            "wall_vs_celery_floor_with_model_calls": (
                round(ours["wall_s"] / floor_calls["wall_s"], 3)
                if "wall_s" in floor_calls else None),
            "cpu_per_task_vs_celery_floor_with_model_calls": (
                round(ours["cpu_ms_per_task_all_processes"]
                      / floor_calls["cpu_ms_per_task_all_processes"], 3)
                if floor_calls.get("cpu_ms_per_task_all_processes") else None),
            "wall_vs_critical_path": round(ours["wall_s"] / critical, 3),
            "cpu_per_task_vs_celery_floor": (
                round(ours["cpu_ms_per_task_all_processes"]
                      / floor["cpu_ms_per_task_all_processes"], 3)
                if floor.get("cpu_ms_per_task_all_processes") else None),
            "redis_commands_per_task_vs_celery_floor": (
                round(ours["redis_commands_per_task_incl_lua"]
                      / floor["redis_commands_per_task_incl_lua"], 3)
                if floor.get("redis_commands_per_task_incl_lua") else None),
        },
    }
    write_json(Path(args.json), report)
    print({k: report[k] for k in ("agentbatch", "celery_floor", "ratios")})
    return 1 if any("error" in f for f in (floor, floor_waits, floor_calls)) else 0


if __name__ == "__main__":
    sys.exit(main())
