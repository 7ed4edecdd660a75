"""kvcloud's own inference worker: the engine (``engine/``), its HTTP API (``http/``), its
benchmarks (``bench/``), the ``kvcloud-worker`` command line (``cli``) and ``make demo``
(``demo``)."""
