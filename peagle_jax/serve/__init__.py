"""``python -m peagle_jax.serve``: the OpenAI-compatible server (see ``__main__``), its slot engine
(``slots``), engine thread (``worker``), request validation (``protocol``), endpoints (``app``), metrics and
the SageMaker deploy logic (``deploy``)."""
