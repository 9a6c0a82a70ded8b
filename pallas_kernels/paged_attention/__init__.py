from pallas_kernels.paged_attention.entry import paged_attention, paged_attention_quantized

__all__ = ["paged_attention", "paged_attention_quantized"]
