"""The JAX route: entry points with custom gradient and batching (ops), call descriptions
(planning), the primitives and their lowerings (primitives), sharding, the callback, the jax.numpy
lowering and the native XLA call; the MLA ops' functional form and primitive (mla). Design:
``docs/jax_internals.md``."""
