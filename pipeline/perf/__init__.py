"""Speed benchmarks (`pipeline bench <what>`): they print numbers; speed is measured here, never asserted in
tests. Task benchmarks (HumanEval, GSM8K, ...) are `pipeline.engines.benchmarks`."""
