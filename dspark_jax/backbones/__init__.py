"""Backbones (target models) behind one interface: see `base.py` for the contract.

    Qwen3Backbone(Qwen3Config)   Hugging Face Qwen3 decoder (its checkpoints: dspark_jax.checkpoint.qwen3_hf)
    MhcBackbone(MhcConfig)       small DeepSeek-V4.1-style model (4-stream mHC, latent MQA + sink, MoE)
"""

from dspark_jax.backbones.base import Backbone, BackboneOutput
from dspark_jax.backbones.mhc import MhcBackbone, MhcCache, MhcConfig
from dspark_jax.backbones.qwen3 import Qwen3Backbone, Qwen3Cache, Qwen3Config

__all__ = ["Backbone", "BackboneOutput", "MhcBackbone", "MhcCache", "MhcConfig", "Qwen3Backbone", "Qwen3Cache",
           "Qwen3Config"]


def __getattr__(name: str):
    """Deprecated: `load_qwen3_hf` lives in `dspark_jax.checkpoint.qwen3_hf` (imported lazily, with a warning)."""
    if name == "load_qwen3_hf":
        import warnings  # noqa: PLC0415

        warnings.warn("dspark_jax.backbones.load_qwen3_hf moved to dspark_jax.checkpoint.qwen3_hf.load_qwen3_hf",
                      DeprecationWarning, stacklevel=2)
        from dspark_jax.checkpoint.qwen3_hf import load_qwen3_hf  # noqa: PLC0415  (lazy: models never import it)

        return load_qwen3_hf
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
