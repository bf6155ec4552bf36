"""Benchmarks: one interface (items with a hidden reference, a scorer returning [0,1] + details)."""

from pipeline.engines.benchmarks.base import Benchmark, BenchmarkError, Item, MetricResult, load_benchmark, split_items

__all__ = ["Benchmark", "BenchmarkError", "Item", "MetricResult", "load_benchmark", "split_items"]
