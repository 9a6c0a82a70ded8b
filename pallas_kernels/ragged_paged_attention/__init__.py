from pallas_kernels.ragged_paged_attention.entry import ragged_paged_attention

__all__ = ["ragged_paged_attention"]
