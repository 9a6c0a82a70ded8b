"""pallas_kernels.lora: the one entry for the batched (multi-adapter) LoRA matmul."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import validate as v
from pallas_kernels.dispatch import bind, dispatch
from pallas_kernels.lora.kernel_gpu import lora_matmul_gpu
from pallas_kernels.lora.kernel_tpu import lora_matmul_tpu
from pallas_kernels.lora.tiles import MAX_SLOTS
from pallas_kernels.lora.xla import lora_matmul_xla


def _xla(x, lora_a, lora_b, slots):
    return lora_matmul_xla(x, lora_a, lora_b, slots).astype(x.dtype)


def lora_matmul(x, lora_a, lora_b, slots, *, interpret=None):
    """The LoRA term of a projection for a batch whose tokens use different adapters
    (S-LoRA / Punica): y[t] = (x[t] @ lora_a[s]) @ lora_b[s] with s = slots[t], zero
    where slots[t] < 0 (a token without an adapter).

    Args:
      x: [num_tokens, d_in], float.
      lora_a: [num_slots, d_in, rank]: each slot's A (kvfold's [in, out] layout).
      lora_b: [num_slots, rank, d_out]: each slot's B with the adapter's scaling folded in.
        Slots an adapter does not fill are zeros (a lower rank pads with zeros).
      slots: int32 [num_tokens], in [-1, num_slots).
      interpret: True runs the Pallas TPU kernel in interpret mode; None runs Mosaic on
        TPU, Triton on GPU and the XLA path (xla.py) elsewhere.

    Returns [num_tokens, d_out] in x.dtype (accumulated in float32).
    """
    v.check_ndim("x", x, 2, "[num_tokens, d_in]")
    v.check_float("x", x)
    v.check_ndim("lora_a", lora_a, 3, "[num_slots, d_in, rank]")
    v.check_ndim("lora_b", lora_b, 3, "[num_slots, rank, d_out]")
    num_slots, d_in, rank = lora_a.shape
    if d_in != x.shape[1]:
        raise ValueError(f"lora_a d_in {d_in} != x's {x.shape[1]}")
    if lora_b.shape[:2] != (num_slots, rank):
        raise ValueError(f"lora_b must be [{num_slots}, {rank}, d_out] to match lora_a, "
                         f"got {tuple(lora_b.shape)}")
    if not 0 < num_slots <= MAX_SLOTS:
        raise ValueError(f"num_slots must be in [1, {MAX_SLOTS}], got {num_slots}")
    v.check_shape("slots", slots, (x.shape[0],))
    v.check_dtype("slots", slots, [jnp.int32])
    return dispatch(x, lora_a, lora_b, slots, ref=bind(_xla), tpu=bind(lora_matmul_tpu),
                    gpu=bind(lora_matmul_gpu), interpret=interpret)
