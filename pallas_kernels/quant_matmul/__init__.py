"""Matmul with a packed (quantized) weight: quant/packed.py holds the packed formats and the
tile dequantizer, ref.py the dequantize-then-matmul statement, cpu.py the CPU kernel (C++
through the XLA FFI, cpu_kernel.cc), xla.py the dequantize-then-matmul path CPU runs for long
steps, kernel_tpu.py and kernel_gpu.py the Pallas kernels (one tile body, tiles.py)."""

from pallas_kernels.quant_matmul.entry import prepare, prepare_params, quant_matmul, quant_matmuls
from quant.packed import PackedWeight

__all__ = ["quant_matmul", "quant_matmuls", "prepare", "prepare_params", "PackedWeight"]
