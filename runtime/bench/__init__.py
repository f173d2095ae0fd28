"""Benchmarks (decode, serving, fusion, export, sharders), their reports and the 8xH100 latency model."""
