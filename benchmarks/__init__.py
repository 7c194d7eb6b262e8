"""Benchmark scripts for vlmspec.

Each script measures something end to end and writes a JSON file with every number, a
markdown table and PNG plots into an output directory given on its command line. The
shared pieces (timing, summary statistics, table / JSON / plot writers, progress bars)
live in :mod:`benchmarks.common`. Run a script as a module from the repository root,
e.g. ``python -m benchmarks.mmbench_spec --help``; the pieces of that benchmark (workloads,
peers, the run loop, aggregation and the report) live in :mod:`benchmarks.spec`. Every
server process a benchmark starts (``vlmspec serve``, ``llama-server``, ``vllm serve``) and the
streaming client that times it live in :mod:`benchmarks.peer_process`.
"""
