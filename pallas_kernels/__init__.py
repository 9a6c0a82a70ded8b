"""Kernels for kvfold (attention, batched LoRA, the quantized-weight matmul, greedy decoding's
pick): one folder per op, each with ref.py (the jnp truth), its Pallas kernel(s) and one
entry function, the only thing the model calls."""

from pallas_kernels.block_sparse_attention import block_sparse_attention
from pallas_kernels.first_max import first_max
from pallas_kernels.indexer import indexer_topk
from pallas_kernels.lora import lora_matmul
from pallas_kernels.merge_states import merge_states
from pallas_kernels.paged_attention import paged_attention, paged_attention_quantized
from pallas_kernels.quant_matmul import quant_matmul
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.variant import AttentionVariant, alibi, sigmoid, soft_cap

__all__ = [
    "paged_attention",
    "paged_attention_quantized",
    "ragged_paged_attention",
    "sparse_attention",
    "block_sparse_attention",
    "indexer_topk",
    "merge_states",
    "lora_matmul",
    "quant_matmul",
    "first_max",
    "AttentionVariant",
    "alibi",
    "sigmoid",
    "soft_cap",
]
