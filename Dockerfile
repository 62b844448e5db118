# nemo_disco on a GPU cluster: an NGC PyTorch image (CUDA, torch, Transformer Engine, apex built together) plus the
# versions the test suites ran (docs/benchmarks.md, "Tested versions"). Usage: docs/quickstart-cluster.md.
#
#   docker build -t nemo-disco:0.1.0 .                                   # from the repository root
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:<release>-py3 -t nemo-disco:0.1.0 .
#
# vLLM wheels pin the torch they were built with. BASE_IMAGE must be an NGC release whose torch satisfies
# vllm==0.32.0's pin: the install below holds the image's own torch with a constraint, so a mismatch stops the
# build at that step (pip: "ResolutionImpossible") instead of replacing the torch that Transformer Engine and apex
# were built against. The default below has not been built here (no Docker, no GPU on the machines that test this
# repository); it is linted with hadolint.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_DISABLE_PROGRESS_BARS=1 \
    NEMO_DISCO_ROOT=/opt/nemo-disco
WORKDIR /opt/nemo-disco

# Dependencies first (a layer that survives code changes). NGC images run Python 3.12: megatron-core 0.19.2 is the
# release tested there (make test-mcore-latest); vllm 0.32.0 and transformers < 5.20 as in make test-vllm;
# math-verify and datasets as in make test. Transformer Engine is the image's own (the gpu extra's pip range has
# not run anywhere); the last line checks that it imports and is in that range.
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/constraints.txt \
    && pip install --constraint /tmp/constraints.txt \
        "megatron-core==0.19.2" \
        "vllm==0.32.0" \
        "transformers>=5.16.1,<5.20" \
        "datasets==5.2.0" \
        "math-verify[antlr4_9_3]==0.9.0" \
        "psutil>=5.9,<8" \
        "tensorboard>=2.15,<3" \
        "matplotlib>=3.8,<4" \
        "wandb>=0.19,<1" \
    && python -c "import transformer_engine as te, packaging.version as v; \
assert v.Version('2.8') <= v.Version(te.__version__) < v.Version('2.21'), te.__version__"

COPY pyproject.toml README.md ./
COPY nemo_disco ./nemo_disco
COPY recipes ./recipes
COPY slurm ./slurm
COPY scripts ./scripts
# The package itself, editable so that recipes/ and slurm/ stay beside it; no dependency is resolved again.
RUN pip install --no-deps -e . \
    && nemo-disco train --config recipes/disco.yaml --print-config > /dev/null
