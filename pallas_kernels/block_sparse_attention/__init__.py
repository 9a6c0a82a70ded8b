from pallas_kernels.block_sparse_attention.entry import block_sparse_attention

__all__ = ["block_sparse_attention"]
