"""Peak memory of chunked vocab-parallel log-probs vs a naive float32 log_softmax over the full logits.

Each measurement runs in a fresh subprocess: it allocates the logits ([batch, tokens, vocab], model dtype)
and targets, resets the kernel's peak-RSS counter (/proc/self/clear_refs), computes the log-probs, and reports
the peak RSS above the level right after allocation (the logits themselves are the model's output in both
cases and are not counted). The naive baseline is ``log_softmax(logits.float() / T).gather(targets)``.

    .venv/bin/python benchmarks/bench_logprob_memory.py                      # 4 x 2048 tokens, vocab 151936
    .venv/bin/python benchmarks/bench_logprob_memory.py --tokens 512 --backward --entropy

The goal is a ratio (chunked / naive) of at most 0.3.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

TEMPERATURE = 0.6


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def measure(args: argparse.Namespace) -> dict:
    """One method in this process; returns peak extra memory (MiB) and wall time."""
    import torch

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    logits = torch.empty(args.batch, args.tokens, args.vocab, dtype=dtype).normal_(generator=g)
    logits.requires_grad_(args.backward)
    targets = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=g)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = _rss_kib("VmRSS")
    start = time.perf_counter()
    with torch.set_grad_enabled(args.backward):
        if args.method == "naive":
            logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)  # [B, S, V] float32
            lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            out = lp.sum() - ((logp.exp() * logp).sum(-1)).sum() if args.entropy else lp.sum()
            del logp
        else:
            from nemo_disco.policy.logprobs import token_logprobs

            lp, ent = token_logprobs(
                logits, targets, temperature=TEMPERATURE, chunk_size=args.chunk, entropy=args.entropy
            )
            out = lp.sum() + ent.sum() if args.entropy else lp.sum()
        if args.backward:
            out.backward()
    seconds = time.perf_counter() - start
    peak = _rss_kib("VmHWM")
    return {"method": args.method, "peak_extra_mib": (peak - base) / 1024, "seconds": seconds, "value": float(out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--chunk", type=int, default=1024, help="policy.logprob_chunk_size")
    parser.add_argument("--entropy", action="store_true")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--method", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.method:
        print(json.dumps(measure(args)))
        return
    root = Path(__file__).resolve().parents[1]
    results = {}
    for method in ("naive", "chunked"):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--method", method]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env={"PYTHONPATH": str(root)})
        if proc.returncode:
            raise SystemExit(f"{method} failed:\n{proc.stderr[-3000:]}")
        results[method] = json.loads(proc.stdout.strip().splitlines()[-1])
    naive, chunked = results["naive"], results["chunked"]
    logits_mib = args.batch * args.tokens * args.vocab * {"float32": 4}.get(args.dtype, 2) / 2**20
    print(
        f"logits [{args.batch} x {args.tokens}, {args.vocab}] {args.dtype} ({logits_mib:.0f} MiB), chunk {args.chunk},"
        f" entropy={args.entropy}, backward={args.backward}"
    )
    for r in (naive, chunked):
        print(f"  {r['method']:8s} peak extra {r['peak_extra_mib']:9.0f} MiB   {r['seconds']:6.2f} s")
    print(f"  ratio chunked / naive = {chunked['peak_extra_mib'] / naive['peak_extra_mib']:.3f} (goal <= 0.3)")
    print(f"  |value difference| = {abs(naive['value'] - chunked['value']):.3g}")


if __name__ == "__main__":
    main()
