"""Serving: KV pages, prefix cache, pure scheduler, engine and the vLLM-style API.

The host-side modules (scheduler, kv_manager, engine, output, simulator) import no jax
and no model; `LLM` (which loads a model) is imported on first use.
"""

from serving.params import CompletionOutput, LoRARequest, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest"]


def __getattr__(name: str):
    if name == "LLM":
        from serving.llm import LLM
        return LLM
    raise AttributeError(f"module 'serving' has no attribute {name!r}")
