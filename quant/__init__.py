"""Number formats and quantizers for kvfold, independent of any model.

- Element codecs and bit packing: e2m1 (FP4), e4m3 (FP8), ue8m0 scales; pack_bits/nibbles.
- Block-scaled formats along the last axis: NVFP4, MXFP4, FP8 E4M3 + UE8M0 (blockscaled).
- LLM.int8() weights and matmul (int8), and the model-facing linear / quantize_params.
- Packed weight-only formats (packed): GGUF's Q8_0 / Q4_0 / Q4_1 blocks kept as they are,
  int8, int4, fp8 E4M3; PackedWeight and pack_params.
- KIVI 2/4-bit KV cache (kivi) and TurboQuant vector quantization (turboquant).
- Per-token int8 / FP8 KV rows with one f32 scale each (kv_rows).

quant imports nothing from model/, serving/ or pallas_kernels/ (they import it).
"""

from typing import TYPE_CHECKING

from quant.blockscaled import (
    FORMATS,
    FP8Block,
    MXFP4,
    NVFP4,
    bytes_per_row,
    fp8_block_dequantize,
    fp8_block_quantize,
    mxfp4_dequantize,
    mxfp4_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
    stored_bytes_per_row,
)
from quant.formats import (
    E2M1_MAGNITUDES,
    E2M1_MAX,
    E4M3_MAX,
    e2m1_decode,
    e2m1_decode_arith,
    e2m1_encode,
    e2m1_encode_scaled,
    e4m3_decode,
    e4m3_decode_arith,
    e4m3_encode,
    ue8m0_decode,
    ue8m0_encode,
)
from quant.int8 import DEFAULT_THRESHOLD, Int8Weight, int8_matmul, quantize_weight
from quant.kivi import (
    KIVI_BITS,
    KiviKeys,
    KiviKV,
    KiviValues,
    kivi_compress,
    kivi_decompress,
    kivi_dequantize_keys,
    kivi_dequantize_values,
    kivi_num_quantized,
    kivi_quantize_keys,
    kivi_quantize_values,
)
from quant.kv_rows import ROW_FORMATS, RowQuantized, dequantize_rows, quantize_rows
from quant.linear import (DEFAULT_LINEAR_NAMES, METHODS, default_linear_predicate, linear, pack_params,
                          quantize_params)
from quant.packed import FORMATS as WEIGHT_FORMATS, PackedWeight
from quant.lloyd_max import sphere_codebook, sphere_codebook_mse
from quant.packing import pack_bits, pack_nibbles, unpack_bits, unpack_nibbles

if TYPE_CHECKING:
    from quant.turboquant import SplitCodes, TurboCodes, TurboQuant, TurboQuantSplit

# quant.turboquant is imported on first use: eagerly importing it here would make
# `python -m quant.turboquant --table` find its own module already loaded (runpy warns).
_LAZY = {name: "quant.turboquant" for name in ("SplitCodes", "TurboCodes", "TurboQuant", "TurboQuantSplit")}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'quant' has no attribute {name!r}")


__all__ = [
    "DEFAULT_LINEAR_NAMES",
    "DEFAULT_THRESHOLD",
    "ROW_FORMATS",
    "RowQuantized",
    "E2M1_MAGNITUDES",
    "E2M1_MAX",
    "E4M3_MAX",
    "FORMATS",
    "FP8Block",
    "Int8Weight",
    "KIVI_BITS",
    "KiviKV",
    "KiviKeys",
    "KiviValues",
    "METHODS",
    "MXFP4",
    "NVFP4",
    "SplitCodes",
    "TurboCodes",
    "TurboQuant",
    "TurboQuantSplit",
    "bytes_per_row",
    "default_linear_predicate",
    "e2m1_decode",
    "e2m1_decode_arith",
    "e2m1_encode",
    "e2m1_encode_scaled",
    "e4m3_decode",
    "e4m3_decode_arith",
    "e4m3_encode",
    "dequantize_rows",
    "fp8_block_dequantize",
    "fp8_block_quantize",
    "int8_matmul",
    "kivi_compress",
    "kivi_decompress",
    "kivi_dequantize_keys",
    "kivi_dequantize_values",
    "kivi_num_quantized",
    "kivi_quantize_keys",
    "kivi_quantize_values",
    "linear",
    "pack_params",
    "PackedWeight",
    "WEIGHT_FORMATS",
    "mxfp4_dequantize",
    "mxfp4_quantize",
    "nvfp4_dequantize",
    "nvfp4_quantize",
    "pack_bits",
    "pack_nibbles",
    "quantize_params",
    "quantize_rows",
    "quantize_weight",
    "sphere_codebook",
    "sphere_codebook_mse",
    "stored_bytes_per_row",
    "ue8m0_decode",
    "ue8m0_encode",
    "unpack_bits",
    "unpack_nibbles",
]
