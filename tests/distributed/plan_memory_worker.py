"""Peak memory of one micro-batch of the Megatron policy on the CPU, measured with torch's memory profiler.

``python plan_memory_worker.py CASES_JSON`` (a list of ``{"model", "rows", "prompt", "response", "recompute",
"dtype"}``): per case, a one-process ``MegatronPolicy`` (local layer spec, gloo) over the model folder, a batch of
``rows`` full-length rows in ONE micro-batch (``policy.microbatch_tokens`` = rows x length), then
``accumulate_gradients`` (forward and backward, entropy included) and ``logprobs`` each run once to warm up and once
under ``torch.profiler.profile(profile_memory=True)``. The peak is read off the profiler's memory timeline
(``_memory_profile().timeline``: every CPU allocation and free, in order): the most bytes allocated during the call
and alive at once, beyond what was alive when it started. Prints one JSON list.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

CHUNK = 64


def measured_peak(fn) -> int:  # noqa: ANN001
    """Peak bytes allocated by ``fn()`` and alive at once (torch's memory profiler, CPU allocations)."""
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


def run(case: dict) -> dict:
    """Measure one case."""
    from megatron_worker import make_cfg

    from nemo_disco.batch import collate
    from nemo_disco.policy import megatron as mp

    rows, prompt, response = case["rows"], case["prompt"], case["response"]
    over = {
        "policy.dtype": case["dtype"],
        "policy.microbatch_tokens": rows * (prompt + response),
        "policy.logprob_chunk_size": CHUNK,
        "policy.activation_checkpointing": case["recompute"],
    }
    policy = mp.MegatronPolicy.from_run_config(make_cfg(1, **over), Path(case["model"]))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 100, (prompt,), generator=g).tolist() for _ in range(rows)]
    responses = [torch.randint(5, 100, (response,), generator=g).tolist() for _ in range(rows)]
    batch = collate(prompts, responses, [[0.0] * response] * rows, list(range(rows)), [1.0] * rows, pad_id=0)
    assert len(policy._microbatches(batch)) == 1

    def surrogate(_rows, lp, ent):  # noqa: ANN001, ANN202
        return lp.sum() + 0.01 * ent.sum()

    def train() -> None:
        policy.accumulate_gradients(batch, surrogate, entropy=True)

    def logprobs() -> None:
        policy.logprobs(batch, entropy=True)

    train()
    logprobs()
    return {**case, "training": measured_peak(train), "logprobs": measured_peak(logprobs)}


def main() -> None:
    """Measure every case, print one JSON list."""
    print(json.dumps([run(case) for case in json.loads(Path(sys.argv[1]).read_text())]))


if __name__ == "__main__":
    main()
