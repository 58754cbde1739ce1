"""Benchmarks: agentbatch beside its peers on the same simulator, results as JSON ratios."""
