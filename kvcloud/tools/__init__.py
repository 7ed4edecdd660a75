"""Operator tools around the data path: the ``kvcloud`` command line (:mod:`.cli`), ``verify``
and ``gc`` (:mod:`.verify`, :mod:`.gc`), ``doctor``, the Prometheus stats exporter, the
store benchmark (:mod:`.bench`) and the sizing of a vLLM fleet (:mod:`.sizing`).

They use the core (client, segment, namespace, stores, indexes); nothing in the core imports
them.
"""
