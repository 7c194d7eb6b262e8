"""Readers of public evaluation and prompt formats shared by training and the benchmarks.

* :mod:`vlmspec.data.mmbench`: MMBench TSV files (multiple-choice questions about one image).
"""

from vlmspec.data.mmbench import MMBenchFile, MMBenchQuestion, RowProblem, build_mmbench_prompt, read_mmbench_tsv

__all__ = ["MMBenchFile", "MMBenchQuestion", "RowProblem", "build_mmbench_prompt", "read_mmbench_tsv"]
