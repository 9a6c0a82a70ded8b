from pallas_kernels.indexer.entry import indexer_topk
from pallas_kernels.indexer.ref import block_candidates

__all__ = ["indexer_topk", "block_candidates"]
