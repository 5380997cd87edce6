"""Checkpoint I/O: safetensors (incl. fp8 / fp4) in plain numpy, the V4.1 `mtp.*` mapping, Orbax.

    params, tied = load_v41_draft("DeepSeek-V4.1-Flash/", cfg)             # our tree + tied embed/head
    export_v41_draft(params, tied, cfg, "out/", fmt="fp8")                 # official layout again
    convert_v41_safetensors("DeepSeek-V4.1-Flash/", cfg, "bf16/", fmt="bf16")   # streaming
    save_params("ckpt/", tree); restore_params("ckpt/", shardings_or_abstract_tree)
"""

from dspark_jax.checkpoint.formats import dequantize_fp4, dequantize_fp8_block, quantize_fp4, quantize_fp8_block
from dspark_jax.checkpoint.orbax_io import restore_params, save_params
from dspark_jax.checkpoint.safetensors_io import (
    CheckpointError, CheckpointReader, SafetensorsFile, SafetensorsWriter, TensorSpec, open_checkpoint, save_file,
)
from dspark_jax.checkpoint.v41 import V41_TABLE, convert_v41_safetensors, export_v41_draft, load_v41_draft

__all__ = [
    "CheckpointError", "CheckpointReader", "SafetensorsFile", "SafetensorsWriter", "TensorSpec", "open_checkpoint",
    "save_file", "dequantize_fp8_block", "quantize_fp8_block", "dequantize_fp4", "quantize_fp4", "V41_TABLE",
    "load_v41_draft", "export_v41_draft", "convert_v41_safetensors", "save_params", "restore_params",
]
