"""The examples a user would copy: the packed-documents block trains (its loss falls) on one device, with
torch.compile(fullgraph=True) on GPUs, and under torchrun at cp = 2, where step 0 equals one device's."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")  # CI installs torch (README)

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def _losses(stdout: str):
    match = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", stdout)
    assert match, stdout
    return float(match.group(1)), float(match.group(2))


def _run(command):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_packed_documents_block_learns(device):
    extra = ["--compile"] if device == "cuda" else []
    first, last = _losses(_run([sys.executable, os.path.join(EXAMPLES, "packed_documents.py"), "--device", device,
                                "--steps", "200", *extra]))
    assert last < 0.6 * first, (first, last)


def test_packed_documents_under_torchrun_at_cp2():  # gloo: CPU ranks (one GPU cannot hold two NCCL ranks)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}",
                os.path.join(EXAMPLES, "packed_documents_cp.py"), "--steps", "200", "--check", "--backend", "gloo"])
    assert "check: step 0 loss" in out and "gradients agree" in out
    first, last = _losses(out)
    assert last < 0.6 * first, (first, last)
