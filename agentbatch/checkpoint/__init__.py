"""Checkpoint and resume for the embedded engine (``checkpoint_dir=``; docs/checkpoints.md)."""

from .attach import close_checkpoint, open_for_batch
from .fingerprint import Fingerprint, batch_fingerprint
from .resume import Resumed, resume
from .store import DB_NAME, CheckpointCorrupted, CheckpointStore, SavedAgent, open_checkpoint

__all__ = ["DB_NAME", "CheckpointCorrupted", "CheckpointStore", "Fingerprint", "Resumed",
           "SavedAgent", "batch_fingerprint", "close_checkpoint", "open_checkpoint",
           "open_for_batch", "resume"]
