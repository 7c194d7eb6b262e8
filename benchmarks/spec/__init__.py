"""The speculative-decoding benchmark behind ``python -m benchmarks.mmbench_spec``, split along its seams.

* :mod:`~benchmarks.spec.choices` - the option letter a free-form answer chose;
* :mod:`~benchmarks.spec.workloads` - :class:`Task` lists from MMBench (read by
  :mod:`vlmspec.data.mmbench`, the reader training uses too), prompt sets, easy-vqa and
  scikit-image photographs, and scoring of answers;
* :mod:`~benchmarks.spec.runs` - vlmspec's side: the engine, generation settings, one timed run, one
  question's results;
* :mod:`~benchmarks.spec.peers` - transformers' ``generate`` (plain, prompt lookup, assistant model) on
  the same model;
* :mod:`~benchmarks.spec.loop` - :class:`Benchmark`, which runs every variant on every task, interleaved;
* :mod:`~benchmarks.spec.aggregate` - totals per workload and category, and one question as JSON;
* :mod:`~benchmarks.spec.report` - the verdict, markdown tables, ``results.json`` and PNG plots.

The command line (options, validation, ``main``) stays in ``benchmarks/mmbench_spec.py``.
"""
