"""The `agentbatch` command: run, demo, sim, worker, status."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Run large batches of tool-using LLM agents.")
console = Console()


@app.command()
def demo(agents: int = typer.Option(100, help="How many agents."),
         fixed_ms: float = typer.Option(60.0, help="Simulated forward-pass time (ms).")) -> None:
    """Start a simulator and run a demo batch with a tool and a schema (embedded engine)."""
    from .demo import run_demo

    with console.status(f"running {agents} agents against a local simulator…"):
        report = run_demo(agents=agents, fixed_ms=fixed_ms)
    table = Table(title="agentbatch demo (embedded engine, simulator)", show_header=False)
    rows = [
        ("agents ok", f"{report['ok']} / {report['agents']}"),
        ("wall time", f"{report['wall_s']:.2f} s"),
        ("critical path (turn + tool + turn)", f"{report['critical_path_s']:.2f} s"),
        ("model turns", str(report["turns"])),
        ("tool calls (served by cache/coalescing)",
         f"{report['tool_calls']} ({report['tool_calls_shared']})"),
        ("prompt tokens (cached)", f"{report['prompt_tokens']} ({report['cached_tokens']})"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    if report["first"]:
        console.print("first result:", report["first"])
    for err in report["errors"]:
        console.print("[red]error[/red]", err)
    if report["ok"] != report["agents"]:
        raise typer.Exit(1)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def sim(ctx: typer.Context) -> None:
    """Serve the inference simulator (flags as `python -m agentbatch.sim --help`)."""
    from .sim.__main__ import main

    main(list(ctx.args))


@app.command()
def worker(
    queues: str = typer.Option("inference,tools", help="inference, tools, or both."),
    concurrency: int = typer.Option(16, help="Task slots (threads) in this process."),
    redis_url: str = typer.Option(None, envvar="AGENTBATCH_REDIS_URL",
                                  help="Redis URL (broker + state)."),
    pool: str = typer.Option("threads", help="Celery pool: threads (IO-bound default), "
                                             "prefork, solo."),
    metrics_port: int = typer.Option(None, help="Serve Prometheus metrics on this port."),
    hostname: str = typer.Option(None, help="Celery node name (default: generated)."),
    loglevel: str = typer.Option("INFO"),
) -> None:
    """Run a worker process that executes agent turns and/or tool calls."""
    if not redis_url:
        raise typer.BadParameter("--redis-url (or AGENTBATCH_REDIS_URL) is required")
    os.environ["AGENTBATCH_REDIS_URL"] = redis_url
    from .workers import app as celery_app
    from .workers.app import celery_config

    celery_app.conf.update(celery_config(redis_url))
    if metrics_port:
        from .workers.metrics import serve_metrics

        serve_metrics(metrics_port)
    argv = ["worker", "-Q", queues, "-c", str(concurrency), "-P", pool, "--loglevel", loglevel,
            "--without-mingle", "--without-gossip"]
    if hostname:
        argv += ["-n", hostname]
    celery_app.worker_main(argv)


@app.command()
def status(batch_id: str,
           redis_url: str = typer.Option(None, envvar="AGENTBATCH_REDIS_URL")) -> None:
    """Show a distributed batch's progress from any machine."""
    from . import get_batch

    counts = get_batch(batch_id, redis_url=redis_url).status()
    table = Table(title=f"batch {batch_id}")
    table.add_column("state")
    table.add_column("count", justify="right")
    for k, v in sorted(counts.items()):
        table.add_row(k, str(v))
    console.print(table)


def _load_inputs(source: Any, base: Path) -> list[dict[str, Any]]:
    if isinstance(source, list):
        return source
    path = (base / str(source)).resolve()
    if path.suffix == ".csv":
        import csv

        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@app.command()
def run(spec: Path = typer.Argument(..., exists=True, help="A YAML batch spec."),
        output: Path = typer.Option(None, "--output", "-o", help="Results JSONL path.")) -> None:
    """Run a batch described by a YAML spec; results are written as JSONL as they arrive."""
    import yaml
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from . import submit_batch
    from .orchestrator.runtime import import_object

    cfg = yaml.safe_load(spec.read_text()) or {}
    inputs = _load_inputs(cfg.pop("inputs", []), spec.parent)
    out_path = output or Path(cfg.pop("output", spec.with_suffix(".results.jsonl").name))
    cfg.pop("output", None)
    task = cfg.pop("task")
    if isinstance(cfg.get("output_schema"), str):
        cfg["output_schema"] = import_object(cfg["output_schema"])
    ok = failed = 0
    handle = submit_batch(task, inputs, **cfg)
    with out_path.open("w") as out, Progress(
        "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console,
    ) as progress:
        bar = progress.add_task(f"batch {handle.batch_id}", total=len(inputs))
        for result in handle.results():
            out.write(json.dumps(result.to_json_dict()) + "\n")
            out.flush()
            ok, failed = ok + result.ok, failed + (not result.ok)
            progress.advance(bar)
    console.print(f"{ok} ok, {failed} failed → {out_path}")
    if failed and not ok:
        sys.exit(1)


def _checkout_module(name: str) -> object:
    """Import a module that lives in a source checkout (benchmarks/, tests/), not the wheel."""
    import importlib

    sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise typer.BadParameter(
            f"{name} is part of the source checkout; run this from the repository root "
            f"({exc})") from None


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def bench(ctx: typer.Context) -> None:
    """Run agentbatch beside the peers on one simulator: `bench [WORKLOAD] --json OUT`.

    WORKLOAD: tool_roundtrip (default), tool_roundtrip_shared, http_clients.
    """
    args = list(ctx.args)
    workload = args.pop(0) if args and not args[0].startswith("-") else "tool_roundtrip"
    if workload == "http_clients":
        module = _checkout_module("benchmarks.bench_http_clients")
        raise typer.Exit(module.main(args))  # type: ignore[attr-defined]
    module = _checkout_module("benchmarks.bench_embedded")
    raise typer.Exit(module.main(["--workload", workload, *args]))  # type: ignore[attr-defined]


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def chaos(ctx: typer.Context) -> None:
    """Run the chaos harness (1,000 agents, worker and submitter kills) and write its report.

    Flags as `python -m tests.chaos.harness --help`, e.g. `--agents 200 --min-kills 3`.
    """
    module = _checkout_module("tests.chaos.harness")
    raise typer.Exit(module.main(list(ctx.args)))  # type: ignore[attr-defined]


def main() -> None:
    app()


if __name__ == "__main__":
    main()
