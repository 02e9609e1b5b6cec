"""Benchmarks: each runs as `python -m bench.NAME` and prints, as its last line, one JSON
object comparing a candidate with a baseline measured in the same run."""
