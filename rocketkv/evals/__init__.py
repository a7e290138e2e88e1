"""The evaluation package: the library code behind the accuracy and benchmark scripts in
``scripts/``, which parse flags, call these modules and the engine, and print.

* ``prompts``: texts, sentences, documents of a token count, the made-up needle fact.
* ``harness``: chat items, batches, one prefill per batch, resuming, workers, the shared flags.
* ``needle``, ``ruler``: the needle grid and the RULER-style tasks as harness items.
* ``metrics``: answer scores, token and distribution agreement, attention-mass coverage.
* ``scoring``: boundary-aware answer scores (whole values, first value stated, list F1).
* ``stats``: Wilson and bootstrap intervals, exact McNemar and sign-flip paired tests.
* ``provenance``: the commit, libraries, checkpoint hash and quantization of a result file.
* ``probes``: what a compressed cache reads at each step and keeps after prefill.
* ``fidelity``: the fidelity prompt set and passes against the full cache.
* ``fidelity_run``: ``scripts/eval_accuracy.py``'s run over prompt lengths, its files, resuming.
* ``duo_identify``: DuoAttention's retrieval-head identification (``scripts/duo_identify.py``).
* ``reports``: tables, figures and result files.
* ``bench``: what the speed and memory scripts share (the flag vocabulary: ``flags.py``).
* ``sweep``, ``cpu_bench``, ``layer_step``, ``dense_bench``, ``profile``, ``compare_hf``,
  ``memory_prediction``: the runs of ``scripts/bench.py``, ``bench_cpu.py``, ``bench_step.py``,
  ``bench_dense.py``, ``profile_step.py``, ``compare_hf.py`` and ``predict_memory.py``.
"""
