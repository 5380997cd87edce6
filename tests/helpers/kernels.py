"""Mosaic-TPU lowering of the Pallas kernels at the V4.1-Flash shapes (kernels/): lowering only, Mosaic's
own compile needs a TPU."""

import jax

V41_SHAPES = dict(b=8, k=5, h=64, hd=512, w=128, v=129280, r=256)


def lower_tpu(fn, *structs) -> str:
    text = jax.export.export(jax.jit(fn), platforms=["tpu"])(*structs).mlir_module()
    assert "tpu_custom_call" in text
    return text
