"""dspark_jax: DSpark speculative decoding (DeepSeek-V4.1 draft) in JAX/Flax."""

__version__ = "0.1.0"
