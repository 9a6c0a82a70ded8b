"""Serving: KV pages, prefix cache, pure scheduler, engine and the vLLM-style API."""

from serving.llm import LLM
from serving.params import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
