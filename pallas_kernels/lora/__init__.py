"""Batched LoRA matmul over adapter slots (S-LoRA / Punica): ref.py is the gathered
statement, xla.py the CPU path, kernel_tpu.py and kernel_gpu.py the Pallas kernels (one body,
tiles.py)."""

from pallas_kernels.lora.entry import lora_matmul

__all__ = ["lora_matmul"]
