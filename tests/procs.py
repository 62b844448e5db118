"""Run a multi-process command (torchrun and its workers) so that a timeout kills every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence


def run_group(cmd: Sequence[str], *, timeout: float, **kwargs: object) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a session of its own.

    On timeout the whole process group is killed (SIGKILL to torchrun alone leaves its workers running and
    holding the CPU for the rest of the suite), then ``subprocess.TimeoutExpired`` is raised with the output.
    """
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
