"""Benchmarking a run's iteration: each method's step timed on the run's own workload.

`benchmark` times one method's jitted programs on every process, `compare`
times several in paired rounds, and `breakdown` splits one step into its
compute, selection and exchange.
"""
