# shellcheck shell=bash disable=SC2034  # ND_* variables are read by the sourcing script
# Shared by slurm/*.sbatch (sourced, never run on its own): python, container flags, runtime
# environment, dry run. The sbatch script sets ND_ROOT (repository root) and ND_NAME before sourcing.
#
# Environment read here (all optional):
#   NEMO_DISCO_PYTHON      python that has nemo_disco installed, as the job's processes see it (default:
#                          `python` inside a container, else $ND_ROOT/.venv/bin/python if it exists, else python3)
#   NEMO_DISCO_CONTAINER   container image for pyxis/enroot (srun --container-image); unset = no container
#   NEMO_DISCO_MOUNTS      srun --container-mounts value (e.g. /lustre:/lustre,$HOME/.cache:/root/.cache);
#                          the repository, recipes, data and run folders must be visible inside
#   NEMO_DISCO_DRY_RUN=1   print the commands and the layout, start nothing

ND_DRY_RUN=${NEMO_DISCO_DRY_RUN:-0}

nd_die() {
  # nd_die CODE MESSAGE: one line on stderr, then exit CODE (2 = bad input, as the CLI).
  echo "${ND_NAME}: error: $2" >&2
  exit "$1"
}

nd_log() {
  echo "[${ND_NAME} $(date '+%F %T')] $*"
}

nd_quote() {
  # The exact command line, shell-quoted, so a printed command can be pasted back into a shell.
  local out
  printf -v out '%q ' "$@"
  echo "${out% }"
}

# ND_HOST_PYTHON: a python on this host for checks made outside any container (a dry run reads the recipe
# with it). ND_PYTHON: the python the job's processes run, inside the container if there is one. Arrays,
# since NEMO_DISCO_PYTHON may be e.g. "conda run -n x python".
if [[ -x "${ND_ROOT}/.venv/bin/python" ]]; then
  ND_HOST_PYTHON=("${ND_ROOT}/.venv/bin/python")
else
  ND_HOST_PYTHON=(python3)
fi
if [[ -n "${NEMO_DISCO_PYTHON:-}" ]]; then
  read -r -a ND_PYTHON <<<"${NEMO_DISCO_PYTHON}"
elif [[ -n "${NEMO_DISCO_CONTAINER:-}" ]]; then
  ND_PYTHON=(python)
else
  ND_PYTHON=("${ND_HOST_PYTHON[@]}")
fi
if [[ -z "${NEMO_DISCO_CONTAINER:-}" ]]; then
  ND_HOST_PYTHON=("${ND_PYTHON[@]}")
fi

# ND_CONTAINER: srun flags of the container (empty without one). A named container is imported once
# per job and reused by every step of it.
ND_CONTAINER=()
if [[ -n "${NEMO_DISCO_CONTAINER:-}" ]]; then
  ND_CONTAINER=("--container-image=${NEMO_DISCO_CONTAINER}" "--container-name=nemo-disco-${SLURM_JOB_ID:-0}"
    "--container-workdir=${PWD}")
  if [[ -n "${NEMO_DISCO_MOUNTS:-}" ]]; then
    ND_CONTAINER+=("--container-mounts=${NEMO_DISCO_MOUNTS}")
  fi
fi

nd_count_gpus() {
  # GPUs this node gives the job: Slurm's GRES count, else CUDA_VISIBLE_DEVICES, else nvidia-smi, else 0.
  if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
    echo "${SLURM_GPUS_ON_NODE}"
  elif [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
    # Set but empty means no GPU.
    local ids
    IFS=, read -r -a ids <<<"${CUDA_VISIBLE_DEVICES}"
    echo "${#ids[@]}"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nvidia-smi -L | grep -c '^GPU'
  else
    echo 0
  fi
}

nd_export_runtime_env() {
  # nd_export_runtime_env PROCS_PER_NODE: the environment every rank starts with (user values win).
  local cpus=${SLURM_CPUS_ON_NODE:-$(nproc)}
  local per_proc=$((cpus / $1))
  # Threads per process: the node's CPUs shared by its processes (torch would otherwise start one
  # thread per core in every process and oversubscribe the node).
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((per_proc > 0 ? per_proc : 1))}
  export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
  # Log lines reach logs/%x-%j.out as they are printed.
  export PYTHONUNBUFFERED=1
  # NCCL: WARN prints only problems; NCCL_DEBUG=INFO (with NCCL_DEBUG_SUBSYS=INIT,NET) shows the rings and
  # the network chosen, the first thing to look at when a multi-node job hangs at start. Site-specific
  # network settings (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_IB_TIMEOUT) are left to the user's environment.
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  # A failed or timed-out collective aborts the process (and so the job) instead of hanging it until
  # the time limit; the collective timeout itself is distributed.init's (30 min: long rollouts on
  # some ranks must not trip it).
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
  # vLLM switches NCCL's cuMem allocator off in the processes it runs in (its sleep mode manages GPU
  # memory itself); set it for every rank from the start so all communicators of the job agree.
  export NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0}
  # The colocated vLLM engine runs inside each training process (distributed_executor_backend=
  # "external_launcher"), which requires the in-process engine core.
  export VLLM_ENABLE_V1_MULTIPROCESSING=0
  # Never PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True here: vLLM's sleep mode refuses it.
}
