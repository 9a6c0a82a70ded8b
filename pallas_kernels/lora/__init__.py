"""Batched LoRA matmul over adapter slots (S-LoRA / Punica): ref.py is the gathered
statement, xla.py the CPU path, kernel.py the Pallas TPU and GPU kernels."""

from pallas_kernels.lora.entry import lora_matmul

__all__ = ["lora_matmul"]
