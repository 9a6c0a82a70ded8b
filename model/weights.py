"""How `model.load` keeps each weight: float arrays, or packed (quantized) forms.

weights_dtype (the same name on `model.load`, `LLM(...)` and `--weights-dtype`):
- None (the default): "gguf" for a GGUF file, which keeps its own blocks as llama.cpp
  does; for a Hugging Face checkpoint every tensor in the load's `dtype` (float32 by
  default). `LLM(tensor_parallel_size > 1)` loads float matrices instead (packed weights
  are not sharded yet).
- "float32" / "bfloat16": the matrices (projections, embedding, head) in that dtype; norms
  and biases in the load's `dtype`.
- "gguf" (GGUF files only): each matrix keeps the file's own blocks where kvfold reads
  them packed (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K); other tensor types are dequantized
  to float32.
- "gguf_a8" (GGUF files only): the same blocks, multiplied as llama.cpp multiplies them:
  every matmul first rounds its activations to int8 per block of the weight's rows
  (quant.packed.round_activation_blocks), which lets a CPU with AVX-512 VNNI use integer
  dot products (faster at decode, and a little less accurate: `python -m serving.bench
  decode --weights-dtype gguf gguf_a8` prints both).
- a packed format of quant/packed.py (q8_0, q4_0, q4_1, q5_0, int8, int4, fp8, w8a8): every
  matrix packed in it (a GGUF tensor already in that type keeps its bytes). q4_k / q5_k /
  q6_k only keep tensors of that type (there is no quantizer for them): "gguf" keeps each
  tensor's own.

Tensors are converted one at a time as the loader reads them, so a load never holds a
float32 copy of more than one tensor. A packed matrix is laid out for the backend's kernel
as it is stored (pallas_kernels.quant_matmul.prepare: on a CPU, codes interleaved four rows
to a word).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from pallas_kernels.quant_matmul.entry import prepare
from quant.packed import FORMATS, GGUF_FORMATS, PackedWeight, concat_columns, from_gguf, quantize

KEEP_GGUF = "gguf"
KEEP_GGUF_A8 = "gguf_a8"  # the file's blocks, with activations rounded to int8 per block
CHUNK_BYTES = 16 << 20  # float32 rows dequantized at a time while packing a matrix
WEIGHTS_DTYPES = ("float32", "bfloat16", KEEP_GGUF, KEEP_GGUF_A8) + tuple(FORMATS)
MATRICES = frozenset({"embed", "lm_head", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"})


def expected_layer_params(config, layer: int) -> frozenset[str]:
    """The param names decoder layer `layer` of a model.config.ModelConfig holds."""
    from model.moe import shapes as moe_shapes

    names = {"attn_norm", "mlp_norm"} | (MATRICES - {"embed", "lm_head"})
    if layer in config.moe_layers:
        names = names - {"w_gate", "w_up", "w_down"} | set(moe_shapes(config))
    if config.attention_bias:
        names |= {"bq", "bk", "bv"}
    if config.attention_out_bias:
        names.add("bo")
    if config.attention_sinks:
        names.add("sinks")
    if config.qk_norm:
        names |= {"q_norm", "k_norm"}
    if config.sandwich_norm:
        names |= {"attn_post_norm", "mlp_post_norm"}
    return frozenset(names)


def check_complete(params: dict, config, source: str) -> None:
    """ValueError unless a loaded checkpoint has every tensor its config declares, and no
    layer tensor it does not (a Qwen3 file without q/k norms would run silently wrong)."""
    missing = [k for k in ("embed", "final_norm") if k not in params]
    if not config.tie_word_embeddings and "lm_head" not in params:
        missing.append("lm_head")
    for i, layer in enumerate(params["layers"]):
        want = expected_layer_params(config, i)
        missing += [f"layer {i} {k}" for k in sorted(want - set(layer))]
        extra = sorted(set(layer) - want)
        if extra:
            raise ValueError(f"checkpoint {source} has layer {i} tensors {extra} that a "
                             f"{config.name} config does not use")
    if missing:
        raise ValueError(f"checkpoint {source} ({config.name}) lacks {missing[:8]}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def resolve_weights_dtype(weights_dtype: str | None, source_kind: str) -> str | None:
    """The weights_dtype a load uses: a GGUF file keeps its own blocks unless told otherwise."""
    check_weights_dtype(weights_dtype, source_kind)
    return KEEP_GGUF if weights_dtype is None and source_kind == "gguf" else weights_dtype


def check_weights_dtype(weights_dtype: str | None, source_kind: str) -> None:
    """ValueError unless weights_dtype is None or one of WEIGHTS_DTYPES usable for the source."""
    if weights_dtype is None:
        return
    if weights_dtype not in WEIGHTS_DTYPES:
        raise ValueError(f"unknown weights_dtype {weights_dtype!r}; allowed: {', '.join(WEIGHTS_DTYPES)}")
    if weights_dtype in (KEEP_GGUF, KEEP_GGUF_A8) and source_kind != "gguf":
        raise ValueError(f"weights_dtype={weights_dtype!r} keeps a GGUF file's own blocks; this source is a "
                         "Hugging Face directory (pick a packed format such as 'int8' or 'q4_1')")


def store_rows(key: str, read: Callable[[int, int], np.ndarray], rows: int,
               weights_dtype: str | None, dtype):
    """One loaded tensor as the model keeps it, read a slice of rows at a time.

    read(r0, r1): float numpy rows [r1 - r0, ...] of the checkpoint's tensor (output
    channels of a projection or the head, vocabulary rows of the embedding). A matrix
    that is packed is read and quantized CHUNK_BYTES of float32 at a time (output
    channels pack independently), so the load never holds its whole float copy.
    """
    if key not in MATRICES or weights_dtype not in FORMATS:
        w = np.asarray(read(0, rows), np.float32)
        if w.ndim == 2 and key != "embed":
            w = np.ascontiguousarray(w.T)  # [out, in] -> the model's [in, out]
        return store(key, w, weights_dtype, dtype)
    first = np.asarray(read(0, 1), np.float32)
    step = max(1, CHUNK_BYTES // (4 * first.shape[-1]))
    return prepare(concat_columns([quantize(np.asarray(read(r0, min(r0 + step, rows)), np.float32).T, weights_dtype)
                                   for r0 in range(0, rows, step)]))


def store(key: str, w: np.ndarray, weights_dtype: str | None, dtype) -> np.ndarray:
    """One loaded float tensor as the model keeps it unpacked: a matrix in "float32" /
    "bfloat16" when weights_dtype says so, anything else in the load's `dtype`.

    key: the param name (a MATRICES entry, or a norm / bias). w: float numpy in the
    model's layout ([in, out] for projections and the head, [V, H] for the embedding).
    Packing goes through `store_rows`, which stores a packed embedding [H, V]
    (model/transformer.py `embed`).
    """
    if key in MATRICES and weights_dtype in ("float32", "bfloat16"):
        import jax.numpy as jnp

        return np.asarray(w, jnp.dtype(weights_dtype))
    return np.asarray(w, dtype)


def store_gguf(key: str, raw: np.ndarray, qtype: str, shape: tuple[int, int],
               weights_dtype: str | None) -> PackedWeight | None:
    """A matrix kept in the GGUF file's own blocks, or None when it is to be dequantized.

    raw: the tensor's uint8 rows ([out, bytes]; vocabulary rows for the embedding and the
    head); shape: (in, out) of the packed weight ((H, V) for the embedding and the head).
    """
    if key not in MATRICES or qtype not in GGUF_FORMATS:
        return None
    fmt = GGUF_FORMATS[qtype].name
    if weights_dtype == KEEP_GGUF_A8:
        return prepare(dataclasses.replace(from_gguf(raw, qtype, shape), int8_activations=True))
    if weights_dtype == KEEP_GGUF or weights_dtype == fmt:
        return prepare(from_gguf(raw, qtype, shape))
    return None
