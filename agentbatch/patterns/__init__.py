"""Patterns built on one or more batches: scatter-gather, broadcast, tree reduce, generate."""
