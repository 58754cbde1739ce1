"""Checkpoint and resume for the embedded engine (``checkpoint_dir=``; docs/checkpoints.md)."""

from agentbatch.embedded.checkpoint.attach import close_checkpoint, open_for_batch
from agentbatch.embedded.checkpoint.fingerprint import Fingerprint, batch_fingerprint
from agentbatch.embedded.checkpoint.resume import Resumed, resume
from agentbatch.embedded.checkpoint.store import (
           DB_NAME,
           CheckpointCorrupted,
           CheckpointStore,
           SavedAgent,
           open_checkpoint,
)

__all__ = ["DB_NAME", "CheckpointCorrupted", "CheckpointStore", "Fingerprint", "Resumed",
           "SavedAgent", "batch_fingerprint", "close_checkpoint", "open_checkpoint",
           "open_for_batch", "resume"]
