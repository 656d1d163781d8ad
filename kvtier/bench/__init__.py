"""Benchmarks behind ``kvtier bench``: ratios measured in one run against a baseline."""
