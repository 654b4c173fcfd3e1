"""The framework routes that a traced or differentiated call takes: torch custom ops (``torch``)
and JAX primitives (``jax``); both end in :func:`cupyrope.execute.run`."""
