"""The `agentbatch` command: run, demo, sim, worker, status."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Literal

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Run large batches of tool-using LLM agents.")
console = Console()


def _flags_take_no_value() -> None:
    """Typer's rich help prints a flag's type (``--force <bool>``) as if it took a value; its
    plain help leaves flags bare. Show no type for flags, in every command's help."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich
    if getattr(shown, "_agentbatch_flags", False):
        return

    # (ctx: typer's vendored click.Context, from a private module)
    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag and self.metavar is None else shown(self, ctx)

    display_type_rich._agentbatch_flags = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_take_no_value()


@app.command()
def demo(agents: int | None = typer.Option(
             None, min=1, help="How many agents (default 100; 20 with --engine llamacpp)."),
         fixed_ms: float = typer.Option(60.0, help="Simulated forward-pass time (ms)."),
         engine: str = typer.Option(
             "sim", help="sim (a local simulator) or llamacpp (a real llama-server with "
             "SmolLM2-135M, built on first use by `agentbatch engine install`)."),
         fault_rate: str | None = typer.Option(
             None, "--fault-rate", help="sim only: random faults the simulator injects, "
             "KIND=RATE[,KIND=RATE] (as `agentbatch sim --fault-rate`), to see failed agents "
             "reported.")) -> None:
    """Start a simulator and run a demo batch with a tool and a schema (embedded engine).

    Exit status: 0 when the batch ran, however many of its agents failed (failures are
    reported as data: the count and the first errors); 1 when it could not run (no engine,
    the server failed to start); 2 for a bad option."""
    from agentbatch.cli.demo import run_demo
    from agentbatch.sim.faults import parse_fault_rates

    if engine == "llamacpp":
        from agentbatch.cli.engine import run_engine_demo

        if fault_rate is not None:
            raise typer.BadParameter("--fault-rate is for the simulator (--engine sim) only",
                                     param_hint="--fault-rate")

        raise typer.Exit(run_engine_demo(console, agents or 20))
    if engine != "sim":
        raise typer.BadParameter(f"--engine must be sim or llamacpp, not {engine!r}")
    try:
        faults = parse_fault_rates(fault_rate)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--fault-rate") from None
    agents = agents or 100
    try:
        with console.status(f"running {agents} agents against a local simulator…"):
            report = run_demo(agents=agents, fixed_ms=fixed_ms, fault_rates=faults)
    except RuntimeError as exc:  # the simulator did not start: the run could not happen
        console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
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
    for err in report["errors"]:  # failed agents are the demo's data, not its failure
        console.print("[red]error[/red]", err)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def sim(ctx: typer.Context) -> None:
    """Serve the inference simulator (flags as `python -m agentbatch.sim --help`)."""
    from agentbatch.sim.__main__ import main

    main(list(ctx.args))


def _check_worker_args(queues: str, redis_url: str) -> None:
    """Refuse a queue no task is routed to, or a URL that is not Redis, before Celery starts
    (it would consume nothing, or retry ``amqp://guest@<url>`` forever)."""
    import difflib

    from agentbatch.core.errors import ConfigError
    from agentbatch.distributed.state.connection import check_url
    from agentbatch.distributed.workers.app import INFERENCE_QUEUE, TOOLS_QUEUE

    known = [INFERENCE_QUEUE, TOOLS_QUEUE]
    names = [q.strip() for q in queues.split(",") if q.strip()]
    if not names:
        raise typer.BadParameter("name at least one queue: inference, tools, or both",
                                 param_hint="--queues")
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise typer.BadParameter(f"unknown queue {name!r}{hint}; agentbatch routes work "
                                     "to 'inference' and 'tools' only", param_hint="--queues")
    try:
        check_url(redis_url)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--redis-url") from None


def _read_url_file(path: Path) -> str:
    """The Redis URL from a file (first line, whitespace stripped); never echoes its text."""
    try:
        url = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(f"cannot read {str(path)!r}: {type(exc).__name__}",
                                 param_hint="--redis-url-file") from None
    if not url or "\n" in url:
        raise typer.BadParameter(f"{str(path)!r} must hold one Redis URL on one line",
                                 param_hint="--redis-url-file")
    return url


def _fail(message: str) -> typer.Exit:
    """One clear line on stderr and exit status 2 (bad input), instead of a traceback."""
    Console(stderr=True).print(f"[red]error:[/red] {escape(message)}", highlight=False,
                               soft_wrap=True)
    return typer.Exit(2)


@app.command()
def worker(
    queues: str = typer.Option("inference,tools", help="inference, tools, or both."),
    concurrency: int = typer.Option(16, min=1, help="Task slots (threads) in this process."),
    redis_url: str = typer.Option(None, envvar="AGENTBATCH_REDIS_URL",
                                  help="Redis URL (broker + state). Shown by `ps`: with a "
                                       "password, prefer the variable or --redis-url-file."),
    redis_url_file: Path = typer.Option(None, envvar="AGENTBATCH_REDIS_URL_FILE",
                                        dir_okay=False,
                                        help="Read the Redis URL from this file (a mounted "
                                             "secret), instead of --redis-url."),
    pool: Literal["threads", "prefork", "solo"] = typer.Option(
        "threads", help="Celery pool: threads (IO-bound default), prefork, solo."),
    metrics_port: int = typer.Option(None, min=1, max=65535,
                                     help="Serve Prometheus metrics on this port."),
    metrics_host: str = typer.Option("127.0.0.1", envvar="AGENTBATCH_METRICS_HOST",
                                     help="Interface the metrics port listens on; "
                                          "0.0.0.0 exposes it to the network (k8s, "
                                          "where a NetworkPolicy limits who reaches it)."),
    hostname: str = typer.Option(None, help="Celery node name (default: generated)."),
    loglevel: str = typer.Option("INFO"),
) -> None:
    """Run a worker process that executes agent turns and/or tool calls."""
    if redis_url_file is not None:
        if redis_url:
            raise typer.BadParameter("give --redis-url (AGENTBATCH_REDIS_URL) or "
                                     "--redis-url-file (AGENTBATCH_REDIS_URL_FILE), not both",
                                     param_hint="--redis-url-file")
        redis_url = _read_url_file(redis_url_file)
    if not redis_url:
        raise typer.BadParameter("--redis-url (or AGENTBATCH_REDIS_URL, or --redis-url-file) "
                                 "is required")
    _check_worker_args(queues, redis_url)
    from agentbatch.core.errors import ConfigError
    from agentbatch.core.import_allowlist import WORKER_IMPORTS_ENV, require_worker_imports
    from agentbatch.distributed.state.connection import refuse_cluster_at
    from agentbatch.distributed.workers.settings import WorkerSettings

    try:  # plans in Redis name modules to import: a worker needs an explicit allowlist
        require_worker_imports(os.environ.get(WORKER_IMPORTS_ENV))
        WorkerSettings.from_env(redis_url)  # a bad AGENTBATCH_RETENTION_S, say, named now
        refuse_cluster_at(redis_url)  # a redis:// URL to a Cluster node: say so, then stop
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    from agentbatch.distributed.workers import app as celery_app
    from agentbatch.distributed.workers.app import celery_config
    from agentbatch.distributed.workers.settings import use_redis_url

    # kept in memory and AGENTBATCH_REDIS_URL scrubbed: tools and subprocesses read os.environ
    use_redis_url(redis_url)

    celery_app.conf.update(celery_config(redis_url))
    if metrics_port:
        from agentbatch.distributed.workers.metrics import prepare_prefork, serve_metrics
        from agentbatch.metrics.server import MetricsPortInUse

        if pool == "prefork":  # values in files every forked child writes, set before forking
            prepare_prefork()
        try:
            serve_metrics(metrics_port, host=metrics_host, redis_url=redis_url)
        except MetricsPortInUse as exc:
            raise _fail(str(exc)) from None
    argv = ["worker", "-Q", queues, "-c", str(concurrency), "-P", pool, "--loglevel", loglevel,
            "--without-mingle", "--without-gossip"]
    if hostname:
        argv += ["-n", hostname]
    celery_app.worker_main(argv)


@app.command()
def status(batch_id: str,
           redis_url: str = typer.Option(None, envvar="AGENTBATCH_REDIS_URL")) -> None:
    """Show a distributed batch's progress from any machine; with ``prices``, its spend so
    far and the projected cost to complete."""
    from agentbatch import get_batch
    from agentbatch.core.errors import AgentBatchError
    from agentbatch.turnloop.progress_display import cost_line

    try:
        handle = get_batch(batch_id, redis_url=redis_url)
        try:
            counts = handle.status()
            cost = cost_line(handle.progress())  # None without prices: nothing about cost
        finally:
            handle.close()
    except AgentBatchError as exc:
        raise _fail(str(exc)) from None
    state = "finished" if counts.get("finished") else "running"
    console.print(f"batch {batch_id}: {state}", highlight=False, markup=False, soft_wrap=True)
    console.print(_status_table(counts))
    if cost is not None:
        console.print(cost, highlight=False, markup=False, soft_wrap=True)


def _status_table(counts: dict[str, int]) -> Table:
    """Agents delivered and by state, then the batch's counters: the status dict mixes a flag
    (``finished``, said above the table) and totals with per-state counts."""
    counts = dict(counts)
    counts.pop("finished", None)
    total, delivered = counts.pop("total", 0), counts.pop("delivered", 0)
    stats = {k: counts.pop(k) for k in sorted(counts) if k.startswith("stat:")}
    table = Table()
    table.add_column("agents")
    table.add_column("count", justify="right")
    table.add_row("delivered", f"{delivered} / {total}")
    for state, n in sorted(counts.items()):
        table.add_row(state.replace("_", " "), str(n))
    if stats:
        table.add_section()
        for name, n in stats.items():
            table.add_row(name.removeprefix("stat:").replace("_", " "), str(n))
    return table


def _run_help() -> str:
    from agentbatch.cli.spec_file import EXAMPLE

    example = "\n".join(f"    {line}" for line in EXAMPLE.splitlines())
    return ("Run a batch described by a YAML spec; results are written as JSONL as they "
            "arrive.\n\nThe spec takes `task`, `inputs`, `output`, `tools` and "
            "`output_schema` (import paths), and any other `submit_batch` keyword. "
            f"Example:\n\n\b\n{example}")


@app.command(help=_run_help())
def run(spec: Path = typer.Argument(..., exists=True, dir_okay=False,
                                    help="A YAML batch spec."),
        output: Path = typer.Option(None, "--output", "-o", help="Results JSONL path."),
        checkpoint_dir: Path = typer.Option(
            None, "--checkpoint-dir", help="Checkpoint the batch here (embedded engine); run "
            "the same command again after a crash to resume it (docs/checkpoints.md).")) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from agentbatch import submit_batch
    from agentbatch.cli.spec_file import load_inputs, load_spec
    from agentbatch.core.errors import AgentBatchError

    try:
        batch = load_spec(spec)
        inputs = load_inputs(batch, spec.parent)
        kwargs = batch.submit_kwargs()
        if checkpoint_dir is not None:
            kwargs["checkpoint_dir"] = str(checkpoint_dir)
        handle = submit_batch(batch.task, inputs, **kwargs)
    except AgentBatchError as exc:
        raise _fail(str(exc)) from None
    out_path = output or Path(batch.output or spec.with_suffix(".results.jsonl").name)
    console.print(f"batch {handle.batch_id}: {len(inputs)} agent(s) on the {handle.runs_on} "
                  "engine", highlight=False, markup=False, soft_wrap=True)
    ok = failed = 0
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


# the subcommands' modules, imported here so each stays one file (none imports this one)
from agentbatch.cli import batches as _batches  # noqa: E402
from agentbatch.cli import dead_letters as _dead_letters  # noqa: E402
from agentbatch.cli import engine as _engine  # noqa: E402
from agentbatch.cli import flower as _flower  # noqa: E402
from agentbatch.cli import show as _show  # noqa: E402
from agentbatch.cli import watch as _watch  # noqa: E402

app.add_typer(_dead_letters.app, name="dead-letters")
app.add_typer(_engine.app, name="engine")
app.command("flower")(_flower.flower)
_batches.register(app)  # ls, rm
app.command("watch")(_watch.watch)
_show.register(app)  # show, export

def main() -> None:
    app()


if __name__ == "__main__":
    main()
