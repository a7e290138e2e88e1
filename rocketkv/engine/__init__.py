"""Running a model: the decode step and its modes (``step``), prefill, the decode loop
(``generate``), the caches kept between calls (``session``), documents, memory and time
measurement, the report, the checks of a run's settings and the kernels' self-check."""
