"""nemo_disco: DisCO (arXiv 2505.12366) post-training on Megatron-Core policies with a colocated vLLM generator."""

__version__ = "0.1.0"
