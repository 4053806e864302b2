"""Benchmarks: ``python -m kvcache.bench <name>``. Each reports ratios to a ceiling
measured in the same run, never absolute pass/fail thresholds."""
