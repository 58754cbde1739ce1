"""Open the checkpoint of a compiled batch and decide where each agent starts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from agentbatch.embedded.checkpoint.fingerprint import batch_fingerprint
from agentbatch.embedded.checkpoint.resume import Resumed, resume
from agentbatch.embedded.checkpoint.store import CheckpointStore, open_checkpoint

if TYPE_CHECKING:
    from agentbatch.core.options import BatchOptions
    from agentbatch.turnloop.compile import CompiledBatch

log = logging.getLogger(__name__)


async def open_for_batch(compiled: CompiledBatch, opts: BatchOptions
                         ) -> tuple[CheckpointStore | None, Resumed]:
    """The open checkpoint (None without ``checkpoint_dir``) and each agent's start state.

    Opening runs in a thread: it reads and checks the whole database.
    """
    if opts.checkpoint_dir is None:
        return None, Resumed(states=list(compiled.states))
    fingerprint = batch_fingerprint(
        opts.task, [s.input for s in compiled.states], opts.system_prompt,
        [t.identity for t in compiled.tools], compiled.contract.json_schema)
    store = await asyncio.to_thread(open_checkpoint, opts.checkpoint_dir, fingerprint)
    resumed = resume(compiled.states, store.saved, retry_failed=opts.retry_failed)
    log.info("batch %s: checkpoint %s: %d agent(s) ended earlier, %d continue, %d failed "
             "and start over", compiled.plan.batch_id, store.where, len(resumed.ended),
             resumed.continued, resumed.retried)
    return store, resumed


async def close_checkpoint(store: CheckpointStore | None) -> None:
    """Flush and close ``store``; never raises (the batch's results matter more)."""
    if store is None:
        return
    with contextlib.suppress(Exception):
        await asyncio.to_thread(store.close)
