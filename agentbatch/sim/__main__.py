"""``python -m agentbatch.sim``: serve the inference simulator until interrupted."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from agentbatch.sim.config import SimConfig, parse_fault_rates
from agentbatch.sim.server import run_sim
from agentbatch.sim.tokens import MAX_MODEL_LEN


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m agentbatch.sim",
        description="OpenAI-compatible scripted inference simulator.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--model",
        action="append",
        dest="models",
        help="served model name (repeatable); any name is accepted unless --strict-models",
    )
    p.add_argument(
        "--strict-models",
        action="store_true",
        help="reject requests for models not listed with --model",
    )
    p.add_argument(
        "--fixed-ms",
        type=float,
        default=None,
        help="flat latency per request; disables the GPU-like engine",
    )
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.05)
    p.add_argument("--decode-ms", type=float, default=8.0)
    p.add_argument("--decode-batch-slope", type=float, default=0.01)
    p.add_argument("--tokens-per-step", type=int, default=4)
    p.add_argument("--max-waiting", type=int, default=None)
    p.add_argument("--queue-full-retry-after-s", type=float, default=1.0)
    p.add_argument("--cache-blocks", type=int, default=100_000)
    p.add_argument("--fault-rate", default="", help="e.g. http_500=0.1,http_429=0.05")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-hold-s", type=float, default=30.0)
    p.add_argument("--batch-latency-s", type=float, default=2.0,
                   help="provider batch APIs: median seconds until a request is done")
    p.add_argument("--batch-latency-spread", type=float, default=0.5,
                   help="log-normal sigma around --batch-latency-s (0: all equal)")
    p.add_argument("--batch-expire-s", type=float, default=86_400.0,
                   help="a provider batch still open this long after creation expires")
    p.add_argument("--batch-failure-rate", type=float, default=0.0,
                   help="probability that one request of a provider batch fails")
    p.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    return p


def config_from_args(argv: Sequence[str] | None = None) -> SimConfig:
    args = build_parser().parse_args(argv)
    kwargs = vars(args)
    strict = kwargs.pop("strict_models")
    rates = parse_fault_rates(kwargs.pop("fault_rate"))
    if not kwargs["models"]:
        kwargs.pop("models")
    return SimConfig(**kwargs, fault_rates=rates, accept_any_model=not strict)


def main(argv: Sequence[str] | None = None) -> None:
    run_sim(config_from_args(argv))


if __name__ == "__main__":
    main()
