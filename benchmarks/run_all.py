"""Run every benchmark (``make bench``); each writes its figures to runs/bench/<name>.json.

Order: step breakdown, memory, scaling, the TRL comparison, every other ``benchmarks/bench_*.py`` found (for
example the chunked log-prob memory benchmark), and ``gpu_check.py`` (the GPU validation: full sizes when a
CUDA device is present, ``--smoke`` otherwise). ``--quick`` is passed to each script that accepts it. A failing
benchmark is reported and the others still run; the exit code is 1 if any failed.

Run::

    .venv/bin/python benchmarks/run_all.py            # full (about 16 minutes on 2 CPU cores)
    .venv/bin/python benchmarks/run_all.py --quick    # a few minutes
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

HERE = Path(__file__).resolve().parent
FIRST = ("bench_step_breakdown.py", "bench_memory.py", "bench_scaling.py", "bench_e2e_trl.py")


def scripts() -> list[Path]:
    """Every benchmark script, in run order (gpu_check.py last)."""
    found = sorted(p.name for p in HERE.glob("bench_*.py"))
    ordered = [n for n in FIRST if n in found] + [n for n in found if n not in FIRST]
    return [HERE / n for n in ordered] + [HERE / "gpu_check.py"]


def _accepts(script: Path, flag: str) -> bool:
    res = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, env=C.bench_env(), timeout=300
    )
    return res.returncode == 0 and flag in res.stdout


def _gpu_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="pass --quick to every benchmark that takes it")
    ap.add_argument("--only", nargs="+", default=None, help="run only these script names (e.g. bench_memory.py)")
    args = ap.parse_args(argv)
    results = []
    for script in scripts():
        if args.only and script.name not in args.only:
            continue
        cmd = [sys.executable, str(script)]
        if script.name == "gpu_check.py":
            cmd += [] if _gpu_present() else ["--smoke"]
            cmd += ["--out", str(C.RESULTS / "gpu_check")]
        elif args.quick and _accepts(script, "--quick"):
            cmd.append("--quick")
        print(f"\n=== {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, env=C.bench_env(), cwd=C.ROOT).returncode
        wall = time.perf_counter() - t0
        results.append({"script": script.name, "command": " ".join(cmd[1:]), "rc": rc, "wall_s": wall})
        print(f"=== {script.name}: exit {rc} in {wall:.0f} s", flush=True)
    path = C.write_json("run_all", {"quick": args.quick, "results": results})
    print("\nbenchmark                       exit   seconds")
    for r in results:
        print(f"{r['script']:30s}  {r['rc']:4d}  {r['wall_s']:8.0f}")
    print(f"wrote {path}")
    print(json.dumps(results))
    return 1 if any(r["rc"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
