"""The one entry the model calls for a projection, and the params pass that feeds it.

    y = quant.linear(x, params["wq"], params.get("bq"))   # float [in, out] or Int8Weight

quantize_params swaps selected float weights for quantized containers; linear dispatches
on the container type, so the model code does not change with the quantization method.
pack_params packs weights in quant/packed.py's formats (GGUF's Q8_0 / Q4_0 / Q4_1 blocks,
int8, int4, fp8), which the model's projection entry (model/lora.py `linear`) sends to
the pallas_kernels.quant_matmul kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from quant.packed import FORMATS, PackedWeight, quantize
from quant.int8 import DEFAULT_THRESHOLD, Int8Weight, int8_matmul, quantize_weight

DEFAULT_LINEAR_NAMES = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"})
METHODS = ("int8",)

Predicate = Callable[[tuple[str, ...], Any], bool]


def default_linear_predicate(path: tuple[str, ...], leaf: Any) -> bool:
    """True for a 2-D float array whose last key is one of DEFAULT_LINEAR_NAMES."""
    return (
        bool(path)
        and path[-1] in DEFAULT_LINEAR_NAMES
        and isinstance(leaf, (jax.Array, np.ndarray))
        and leaf.ndim == 2
        and jnp.issubdtype(leaf.dtype, jnp.floating)
    )


def _check_float(params: Any) -> None:
    """ValueError when params already hold packed weights (which would pass through
    unchanged): model.load keeps a GGUF file's own blocks unless told otherwise."""
    packed = [w for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, PackedWeight))
              if isinstance(w, PackedWeight)]
    if packed:
        raise ValueError(f"params hold {len(packed)} packed ({packed[0].fmt}) weights, which cannot be "
                         "quantized again: load float weights with model.load(..., weights_dtype='float32')")


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def quantize_params(
    params: Any, method: str = "int8", predicate: Predicate = default_linear_predicate
) -> Any:
    """Returns params with every leaf selected by `predicate` replaced by its quantized form.

    params: any pytree (typically nested dicts of arrays; weights laid out [in, out]).
    method: one of METHODS ("int8": LLM.int8() Int8Weight).
    predicate(path, leaf): path is the tuple of key names from the root (dict keys,
    attribute names and sequence indices as strings). The default selects 2-D float
    arrays whose last key is in DEFAULT_LINEAR_NAMES.
    Other leaves are returned unchanged (same objects).
    """
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; allowed: {', '.join(METHODS)}")
    _check_float(params)

    def convert(keypath, leaf):
        path = tuple(_key_name(k) for k in keypath)
        return quantize_weight(leaf) if predicate(path, leaf) else leaf

    return jax.tree_util.tree_map_with_path(convert, params)


def pack_params(params: Any, fmt: str, predicate: Predicate = default_linear_predicate) -> Any:
    """params with every leaf selected by `predicate` packed in `fmt` (a
    quant/packed.py FORMATS key: q8_0, q4_0, q4_1, int8, int4, fp8).

    Weights are [in, out], as for quantize_params; other leaves are returned unchanged.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; allowed: {', '.join(FORMATS)}")
    _check_float(params)

    def convert(keypath, leaf):
        path = tuple(_key_name(k) for k in keypath)
        return quantize(leaf, fmt) if predicate(path, leaf) else leaf

    return jax.tree_util.tree_map_with_path(convert, params)


def linear(x: jax.Array, w: jax.Array | Int8Weight, b: jax.Array | None = None) -> jax.Array:
    """x [..., in] times a weight [in, out] (a float array or an Int8Weight), plus b [out].

    Float weights use a plain matmul; Int8Weight uses LLM.int8() with threshold 6.0.
    Returns [..., out].
    """
    if isinstance(w, Int8Weight):
        y = int8_matmul(x, w, DEFAULT_THRESHOLD)
    elif isinstance(w, (jax.Array, np.ndarray)):
        if w.ndim != 2 or x.shape[-1] != w.shape[0]:
            raise ValueError(f"linear: x {x.shape} does not match weight [in, out] {w.shape}")
        y = jnp.matmul(x, w)
    else:
        raise TypeError(
            f"linear: unsupported weight type {type(w).__name__}; expected an array or Int8Weight"
        )
    return y if b is None else y + b
