"""JAX primitives: custom gradient and batching, the jax.numpy lowering, the native XLA call and
sharding."""
