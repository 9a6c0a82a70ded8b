from pallas_kernels.paged_attention.entry import paged_attention

__all__ = ["paged_attention"]
