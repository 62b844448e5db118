"""Rollout generators: one protocol, a colocated vLLM backend and a transformers backend."""

from nemo_disco.generation.base import Generator, Rollout, SamplingParams

__all__ = ["Generator", "Rollout", "SamplingParams"]
