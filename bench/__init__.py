"""Benchmarks: each prints one JSON object of ratios measured side by side in one run."""
