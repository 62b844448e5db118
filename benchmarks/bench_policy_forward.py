"""The transformers policy's training update on its two forward paths, interleaved in one process.

``HFPolicy.forward_path`` is ``"modules"`` (``nemo_disco.policy.hf_forward``: the model's modules with a fused
RMSNorm, a two-product rotary embedding and the mask made once) for the Llama-family models it supports, and
``"model"`` (the model's own ``forward``) otherwise. Both give the same logits and gradients bit for bit
(tests/unit/test_policy_hf_forward.py); this measures what the first saves. One ``train_minibatch`` call (one
forward with gradients, the backward of a log-prob surrogate, gradient clipping, AdamW) on the end-to-end
benchmark's model and batch shape: a random tiny Qwen2 (4 layers, hidden 128, 4 heads, 2 KV heads, vocab
128), 128 rollouts of left-padded prompts (5-12 tokens) and 128 response tokens, one micro-batch. The two
paths alternate call by call, so a slow phase of a shared machine hits both alike.

Run::

    .venv/bin/python benchmarks/bench_policy_forward.py                  # 2 threads, 16 calls per path
    .venv/bin/python benchmarks/bench_policy_forward.py --threads 1 --calls 8
    .venv/bin/python benchmarks/bench_policy_forward.py --quick          # 4 calls per path
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

PATHS = ("model", "modules")


def _batch(rows: int, prompt: int, response: int, seed: int = 0):  # noqa: ANN202
    import torch

    from nemo_disco.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, prompt + 1, (rows,), generator=g)
    prompt_mask = torch.arange(prompt).unsqueeze(0) >= (prompt - lengths).unsqueeze(1)
    return RolloutBatch(
        prompt_ids=torch.randint(2, 128, (rows, prompt), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(2, 128, (rows, response), generator=g),
        response_mask=torch.ones(rows, response, dtype=torch.bool),
        group_ids=torch.arange(rows) // 8,
        rewards=torch.rand(rows, generator=g),
        gen_logprobs=torch.zeros(rows, response),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--calls", type=int, default=16, help="measured train_minibatch calls per path")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=12)
    ap.add_argument("--response-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="4 calls per path")
    args = ap.parse_args(argv)
    if args.quick:
        args.calls = 4

    import torch

    from nemo_disco.policy.hf import HFPolicy

    threads = C.set_threads(args.threads)
    model_dir = C.build_bench_model(C.RESULTS / "e2e_model")
    with tempfile.TemporaryDirectory(prefix="bench_policy_forward_") as tmp:
        cfg = C.load_config(Path(tmp), [f"policy.model_path={model_dir}", "policy.microbatch_tokens=1000000"])
        policy = HFPolicy.from_run_config(cfg, model_dir)
    if policy.forward_path != "modules":
        raise RuntimeError(f"{model_dir}: the policy does not take the modules path ({policy.forward_path})")
    batch = _batch(args.rows, args.prompt_tokens, args.response_tokens)
    weights = torch.randn(batch.response_ids.shape, generator=torch.Generator().manual_seed(1)) / 1000

    def call(path: str) -> float:
        policy.forward_path = path
        t0 = time.perf_counter()
        policy.train_minibatch(batch, lambda rows, lp, ent: (lp * weights[rows]).sum())
        return time.perf_counter() - t0

    for path in PATHS * 2:  # warm-up
        call(path)
    seconds: dict[str, list[float]] = {p: [] for p in PATHS}
    for i in range(args.calls):
        for path in PATHS if i % 2 else PATHS[::-1]:
            seconds[path].append(call(path))
    table = {p: C.summarize(s) for p, s in seconds.items()}
    saved = 1 - table["modules"]["median"] / table["model"]["median"]
    tokens = batch.num_tokens
    print(f"threads {threads}; {args.rows} rows x ({batch.prompt_ids.shape[1]} + {args.response_tokens}) tokens")
    print("| forward path | s per update, median (min-max) |")
    print("| --- | --- |")
    for p, s in table.items():
        print(f"| {p} | {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}) |")
    print(f"modules path: {100 * saved:.1f}% less time per update (ratio of medians)")
    result = {"threads": threads, "rows": args.rows, "tokens": tokens, "seconds": table, "saved": saved}
    path = C.write_json(f"policy_forward_t{threads}", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
