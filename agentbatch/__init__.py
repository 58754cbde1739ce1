"""agentbatch: run large batches of tool-using LLM agents.

Input list in, structured result list out, each result streamed as its agent finishes.
Embedded on asyncio by default; distributed over Celery + Redis when a Redis URL is given.
"""

from agentbatch.api import (
    arun_batch,
    asubmit_batch,
    get_batch,
    run_batch,
    submit_batch,
)
from agentbatch.core.errors import (
    AgentBatchError,
    BackendError,
    BatchExpired,
    BatchLost,
    BatchSpecError,
    ConfigError,
    RedisOutOfMemory,
    ToolError,
)
from agentbatch.core.results import AgentError, AgentResult, ToolCallRecord
from agentbatch.core.version import __version__ as __version__
from agentbatch.patterns.generate import agenerate_batch, generate_batch
from agentbatch.patterns.map_reduce import arun_with_map_reduce, run_with_map_reduce
from agentbatch.patterns.pipeline_error import PipelineError
from agentbatch.patterns.pipeline_handle import get_pipeline
from agentbatch.patterns.reduce import arun_with_reduce, run_with_reduce
from agentbatch.patterns.scatter import abroadcast, ascatter_gather, broadcast, scatter_gather
from agentbatch.patterns.tree import atree_reduce, tree_reduce
from agentbatch.toolpool import Tool, ToolContext, tool
from agentbatch.turnloop.handle import BatchHandle

__all__ = [
    # running batches
    "submit_batch", "asubmit_batch", "run_batch", "arun_batch", "get_batch", "BatchHandle",
    "get_pipeline",
    # patterns over several batches
    "run_with_reduce", "arun_with_reduce", "run_with_map_reduce", "arun_with_map_reduce",
    "PipelineError",
    # aurora-swarm's patterns over an endpoint pool
    "scatter_gather", "ascatter_gather", "broadcast", "abroadcast", "tree_reduce",
    "atree_reduce", "generate_batch", "agenerate_batch",
    # results
    "AgentResult", "AgentError", "ToolCallRecord",
    # tools
    "Tool", "tool", "ToolContext",
    # errors
    "AgentBatchError", "BatchSpecError", "BackendError", "ConfigError", "ToolError",
    "BatchLost", "BatchExpired", "RedisOutOfMemory",
]
