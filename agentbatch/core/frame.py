"""Results as a pandas DataFrame (``handle.to_pandas()``); pandas is the optional extra
``agentbatch[pandas]``, imported only here and only when asked for."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from agentbatch.core.results import AgentResult

if TYPE_CHECKING:
    import pandas

PANDAS_MISSING = ("to_pandas() needs pandas, an optional extra: "
                  "pip install 'agentbatch[pandas]'")


def result_row(result: AgentResult) -> dict[str, Any]:
    """One flat row: ``error`` as ``error_kind``/``error_message``, ``usage`` as its token
    counts; ``input``, ``output``, ``tool_calls`` and ``messages`` stay JSON values."""
    row = result.to_json_dict()
    error = row.pop("error") or {}
    usage = row.pop("usage") or {}
    row["error_kind"], row["error_message"] = error.get("kind"), error.get("message")
    for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        row[name] = usage.get(name, 0)
    return row


def results_frame(results: Iterable[AgentResult]) -> pandas.DataFrame:
    """A DataFrame with one row per result, indexed by the agent's index."""
    try:
        import pandas as pd
    except ImportError as exc:
        raise ImportError(PANDAS_MISSING) from exc
    rows = [result_row(r) for r in sorted(results, key=lambda r: r.index)]
    frame = pd.DataFrame(rows, columns=list(rows[0]) if rows else ["index"])
    return frame.set_index("index")
