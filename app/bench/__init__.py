"""Benchmarks and load: Spec-Bench, kernel and row timings, structured output, the traffic workloads, the load
test, synthetic targets and the llama.cpp baseline."""
