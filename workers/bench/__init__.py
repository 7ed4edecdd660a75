"""The worker's benchmarks, one module per job: ``ttft`` (restore vs recompute across
processes, with the ``naive`` hand-written baseline), ``costmodel`` (a throttled store),
``decode`` (a busy uploader), ``codec`` (int8 vs lossless on a real checkpoint) and ``suite``
(what ``make bench`` runs); ``cli`` adds them to ``kvcloud-worker bench``. They run against
the ``backends`` (file, or moto_server + redis-server, optionally behind the ``netem`` shaping
proxy) and drive the engine (``workers.engine``), which never imports them."""
