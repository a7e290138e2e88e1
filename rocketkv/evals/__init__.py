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
* ``reports``: tables, figures and result files.
* ``bench``: what the speed and memory scripts share (the flag vocabulary: ``flags.py``).
"""
