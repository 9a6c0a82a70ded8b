from pallas_kernels.sparse_attention.entry import sparse_attention

__all__ = ["sparse_attention"]
