"""The package version, read by workers to name the version a plan was written by."""

__version__ = "0.1.0"
