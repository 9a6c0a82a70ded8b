from pallas_kernels.ragged_paged_attention.entry import ragged_paged_attention
from pallas_kernels.tree_mask import TreeMask, pack_mask

__all__ = ["TreeMask", "pack_mask", "ragged_paged_attention"]
