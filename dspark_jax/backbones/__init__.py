"""Backbones (target models) behind one interface: see `base.py` for the contract.

    Qwen3Backbone(Qwen3Config)   Hugging Face Qwen3 decoder; `load_qwen3_hf(dir)` reads its checkpoints
    MhcBackbone(MhcConfig)       small DeepSeek-V4.1-style model (4-stream mHC, latent MQA + sink, MoE)
"""

from dspark_jax.backbones.base import Backbone, BackboneOutput
from dspark_jax.backbones.mhc import MhcBackbone, MhcCache, MhcConfig
from dspark_jax.backbones.qwen3 import Qwen3Backbone, Qwen3Cache, Qwen3Config, load_qwen3_hf

__all__ = ["Backbone", "BackboneOutput", "MhcBackbone", "MhcCache", "MhcConfig", "Qwen3Backbone", "Qwen3Cache",
           "Qwen3Config", "load_qwen3_hf"]
