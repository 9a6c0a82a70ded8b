"""What the network computes: configs, layers, the pure forward pass, loaders."""

from model.config import ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeScaling
from model.context import ForwardContext, RaggedLayout, TokenTree
from model.kv_cache import CacheLayout, KVCache
from model.kv_formats import KV_CACHE_DTYPES, KVPages
from model.loader import default_model_path, load, load_tokenizer, source_path
from model.sharding import make_mesh, shard_params
from model.tokenizer import Tokenizer
from model.transformer import (LAYER_KINDS, LayerKind, forward, forward_hidden, forward_packed,
                               init_cache, init_kv_pool, init_paged_cache, init_params, lm_head, packed_rope)

__all__ = [
    "ATTENTION", "SLIDING_ATTENTION", "LAYER_KINDS", "CacheLayout", "ForwardContext", "KVCache",
    "KV_CACHE_DTYPES", "KVPages", "RaggedLayout",
    "LayerKind", "ModelConfig", "RopeScaling", "Tokenizer", "TokenTree", "default_model_path", "forward",
    "forward_hidden", "forward_packed", "init_cache", "init_kv_pool", "init_paged_cache", "init_params",
    "lm_head", "load", "load_tokenizer", "make_mesh", "packed_rope", "shard_params", "source_path",
]
