"""Bytes of agent state written to and read back from Redis per agent, by tool rounds.

One agent makes N tool rounds whose tool returns 2 KB, then answers, on a real redis-server,
a real ``agentbatch worker`` and the simulator. Redis ``MONITOR`` (inside scripts included)
records every write to the agent's state (``HSET`` of the ``state`` hash, ``RPUSH`` to its
conversation list); replaying them gives the bytes each read of that state returned
(``HGET state``, ``LRANGE msgs``). Each code version runs in its own process with its own
``agentbatch`` (``--code PATH``, e.g. a ``git worktree`` of an older commit), so a
before/after comparison is one invocation:

    git worktree add /tmp/before <commit>
    python -m benchmarks.bench_state_bytes --code before=/tmp/before --code after=.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
TOOL_MODULE = "ab_state_bytes_tools"
TOOL_SOURCE = '''
from agentbatch import tool


@tool
def pad(n: int) -> str:
    """Return 2 KB of text for round n."""
    return (f"round {n}: " + "x" * 2048)[:2048]
'''


class StateReplay:
    """Replays the monitored commands on one batch's state and counts bytes both ways."""

    def __init__(self) -> None:
        self.state: dict[bytes, int] = {}  # index -> bytes of its state entry
        self.msgs: dict[bytes, list[int]] = {}  # msgs key -> entry sizes
        self.written = 0
        self.read = 0
        self.writes = 0
        self.reads = 0

    def feed(self, args: list[bytes]) -> None:
        if not args:
            return
        cmd = args[0].upper()
        key = args[1] if len(args) > 1 else b""
        if key.endswith(b":state"):
            if cmd == b"HSET":
                for i in range(2, len(args) - 1, 2):
                    self.state[args[i]] = len(args[i + 1])
                    self.written += len(args[i + 1])
                    self.writes += 1
            elif cmd == b"HGET" and len(args) > 2:
                self.read += self.state.get(args[2], 0)
                self.reads += 1
        elif b":msgs:" in key or b":calls:" in key:
            if cmd == b"RPUSH":
                sizes = [len(a) for a in args[2:]]
                self.msgs.setdefault(key, []).extend(sizes)
                self.written += sum(sizes)
                self.writes += 1
            elif cmd == b"LRANGE":
                self.read += sum(self.msgs.get(key, []))
                self.reads += 1
            elif cmd == b"LINDEX":
                self.read += (self.msgs.get(key) or [0])[-1]
                self.reads += 1
            elif cmd == b"DEL":
                self.msgs.pop(key, None)


def _monitor_recorder() -> Any:
    """``MonitorRecorder`` from this file's checkout: the one measured may predate it."""
    path = HERE.parents[1] / "tests" / "support" / "redis_monitor.py"
    spec = importlib.util.spec_from_file_location("ab_redis_monitor", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MonitorRecorder


def run_one(rounds: int) -> dict[str, Any]:
    """One agent with ``rounds`` tool rounds on the ``agentbatch`` found on sys.path."""
    from agentbatch import submit_batch
    from agentbatch.sim.config import SimConfig
    from agentbatch.sim.process import SimProcess
    from tests.support.redis_server import RedisServer
    from tests.support.workers import WorkerProcess

    server = RedisServer().start()
    sim = SimProcess(SimConfig(fixed_ms=5)).start()
    worker = WorkerProcess(server.url, concurrency=4, name="bytes",
                           env={"AGENTBATCH_WORKER_IMPORTS": f"tests.support,{TOOL_MODULE}",
                                "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    replay = StateReplay()
    try:
        worker.start()
        task = "Agent {i}.\n" + "".join(f'@sim tool pad {{{{"n": {n}}}}}\n' for n in range(rounds))
        from importlib import import_module
        pad = import_module(TOOL_MODULE).pad
        backend = "sim://" + sim.url.split("://", 1)[1]
        with _monitor_recorder()(server.url) as monitor:
            started = time.monotonic()
            results = submit_batch(task, [{"i": 0}], tools=[pad], model="sim-model",
                                   backend=backend, redis_url=server.url,
                                   max_turns=rounds + 2).wait(timeout=300)
            wall = time.monotonic() - started
        for command in monitor.commands:
            replay.feed(command)
    finally:
        worker.stop(timeout=30)
        sim.stop()
        server.cleanup()
    result = results[0]
    if not result.ok or len(result.tool_calls) != rounds:
        raise RuntimeError(f"the agent did not make {rounds} tool rounds: {result!r}")
    return {"tool_rounds": rounds, "turns": result.turns, "tool_calls": len(result.tool_calls),
            "state_bytes_written": replay.written, "state_bytes_read_back": replay.read,
            "state_writes": replay.writes, "state_reads": replay.reads,
            "wall_s": round(wall, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", default="10,20", help="tool rounds per agent, comma-separated")
    p.add_argument("--code", action="append", default=[],
                   help="LABEL=PATH of a checkout to measure (repeat); default: after=.")
    p.add_argument("--json", default="benchmarks/results/state_bytes.json")
    p.add_argument("--inner", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner is not None:
        print(json.dumps(run_one(args.inner)))
        return 0
    sys.path.insert(0, str(HERE.parents[1]))
    from benchmarks.code_versions import parse_codes, run_inner
    from benchmarks.machine import machine_info, utc_now, write_json

    codes = parse_codes(args.code)
    rounds = [int(r) for r in args.rounds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tool_dir = Path(tmp)
        (tool_dir / f"{TOOL_MODULE}.py").write_text(TOOL_SOURCE)
        for n in rounds:
            for label, path in codes:
                row = run_inner(HERE, label, path, str(n), extra_path=tool_dir)
                print(row, flush=True)
                rows.append(row)
    ratios = {}
    labels = [label for label, _ in codes]
    if len(labels) >= 2:
        first, last = labels[0], labels[-1]
        for n in rounds:
            a = next(r for r in rows if r["code"] == first and r["tool_rounds"] == n)
            b = next(r for r in rows if r["code"] == last and r["tool_rounds"] == n)
            ratios[str(n)] = {
                f"written_{last}_vs_{first}": round(b["state_bytes_written"]
                                                     / a["state_bytes_written"], 3),
                f"read_{last}_vs_{first}": round(b["state_bytes_read_back"]
                                                  / a["state_bytes_read_back"], 3),
            }
    report = {"benchmark": "state_bytes", "when": utc_now(), "machine": machine_info(),
              "workload": {"agents": 1, "tool_output_bytes": 2048, "rounds": rounds},
              "rows": rows, "ratios": ratios}
    write_json(Path(args.json), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
