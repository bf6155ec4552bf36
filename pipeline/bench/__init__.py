"""Benchmarks printing numbers (`pipeline bench <what>`); speed is measured here, never asserted in tests."""
