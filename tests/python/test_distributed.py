"""The torch.distributed API on 2-4 CPU processes (gloo): every case of distributed_worker.py under torchrun and
under mpirun, each rank checked against one device and the fp64 reference; random cases of
distributed_random_worker.py against the fp64 reference."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")  # CI installs torch (README)

WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")
CASES = 14  # 'ok' lines the worker prints on rank 0
RANDOM_WORKER = os.path.join(os.path.dirname(__file__), "distributed_random_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(command, extra_env, cases=CASES):
    # gloo: the CPU engine, also on a GPU machine (its one GPU cannot hold several NCCL ranks)
    env = dict(os.environ, OMP_NUM_THREADS="1", MAGI_TEST_DIST_BACKEND="gloo")
    env.update(extra_env)
    env.pop("MAGI_ATTENTION_DETERMINISTIC_MODE", None)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    oks = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert len(oks) == cases, result.stdout + result.stderr[-3000:]
    return oks


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_under_torchrun(ranks):
    oks = _run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                f"--master-port={_free_port()}", WORKER], {})
    assert all(f"cp={ranks}" in line for line in oks if "cp=" in line or "max area" in line)


@pytest.mark.parametrize("ranks", [3])
def test_random_cases_under_torchrun(ranks):
    """distributed_random_worker.py: random valid problems on a fresh seed (named on failure)."""
    seed, cases = int.from_bytes(os.urandom(4), "little"), 30
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MAGI_ATTENTION_DETERMINISTIC_MODE", None)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                             f"--master-port={_free_port()}", RANDOM_WORKER, str(seed), str(cases)],
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"seed {seed}\n" + result.stdout[-3000:] + result.stderr[-6000:]
    assert f"ok random {cases} cases, seed {seed}" in result.stdout, result.stdout[-3000:]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (CI installs openmpi-bin)")
def test_under_mpirun():
    flags = ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    _run(["mpirun", "-np", "2", *flags, "-x", "MASTER_PORT", "-x", "OMP_NUM_THREADS", "-x", "MAGI_TEST_DIST_BACKEND", sys.executable, WORKER],
         {"MASTER_PORT": str(_free_port())})


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")
def test_nccl_engine_on_one_gpu():
    """The NCCL path (id broadcast over the group, device runtime, torch's stream) at cp = 1: the machines lent
    here have one GPU."""
    env = {"MAGI_TEST_DIST_BACKEND": "nccl"}
    oks = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={_free_port()}",
                WORKER], env, cases=CASES - 1)  # 'groups end with torch' runs on gloo groups only
    assert all("cp=1" in line for line in oks if "cp=" in line or "max area" in line)


def test_init_distributed_picks_the_backend(tmp_path):
    """backend=None under torchrun: NCCL where CUDA is available, else gloo; one rank."""
    script = tmp_path / "init.py"
    script.write_text("import magi_attn as ma, torch.distributed as dist\n"
                      "rank, size, local = ma.init_distributed()\n"
                      "print('backend', dist.get_backend(), rank, size, local)\n"
                      "dist.destroy_process_group()\n")
    env = {k: v for k, v in os.environ.items() if k != "MAGI_TEST_DIST_BACKEND"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
                             f"--master-port={_free_port()}", str(script)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    expected = "nccl" if __import__("torch").cuda.is_available() else "gloo"
    assert f"backend {expected} 0 1 0" in result.stdout, result.stdout + result.stderr[-3000:]


EDGES = """
import numpy as np, torch, magi_attn as ma, torch.distributed as dist
ma.init_distributed(backend="gloo")
torch.manual_seed(0)  # the same tensors on every rank
T = 40
key = ma.magi_attn_flex_key([[0, T]], [[0, T]], [1], T, T, 2, 1, 8, chunk_size=np.int64(8))  # numpy ints pass
for bad in ({"chunk_size": 2**40}, {"overlap_degree": -2**40}, {"chunk_size": 2**31}):
    try:  # was nanobind's TypeError 'incompatible function arguments'
        ma.magi_attn_flex_key([[0, T]], [[0, T]], [1], T, T, 2, 1, 8, **bad)
    except ValueError as e:
        assert "does not fit int32" in str(e) and next(iter(bad)) in str(e), e
    else:
        raise AssertionError(bad)
x = torch.randn(T, 2, 8, dtype=torch.float64)
for shift in (2**70 + 3, -2**63, np.int64(-5)):  # beyond int64 was nanobind's TypeError; rolls are modulo T
    assert torch.equal(ma.undispatch(ma.roll(ma.dispatch(x, key), shift, key), key), x.roll(int(shift) % T, 0))
# dispatch / roll / undispatch are linear: under create_graph their gradients keep a graph (they had none)
q = x.clone().requires_grad_()
g, = torch.autograd.grad(ma.undispatch(ma.roll(ma.dispatch(q, key), 3, key), key).pow(2).sum(), q, create_graph=True)
assert g.requires_grad and torch.allclose(g, 2 * q)
h, = torch.autograd.grad(g.sum(), q)
assert torch.allclose(h, torch.full_like(q, 2.0))
# complex tensors: their gradient was silently dropped (moved as bytes), and a lazy conj() was torch's RuntimeError
z = torch.randn(T, 3, dtype=torch.complex64, requires_grad=True)
moved = ma.undispatch(ma.roll(ma.dispatch(z, key), 2, key), key)
assert torch.equal(moved, z.detach().roll(2, 0))
(moved.abs() ** 2).sum().backward()
assert torch.allclose(z.grad, 2 * z.detach())
assert torch.equal(ma.undispatch(ma.dispatch(z.detach().conj(), key), key), z.detach().conj().resolve_conj())
# calc_attn's gradients are not differentiable: an error, not a term silently dropped
k, v = (torch.randn(T, 1, 8, dtype=torch.float64) for _ in range(2))
out, _ = ma.calc_attn(ma.dispatch(q, key), ma.dispatch(k, key), ma.dispatch(v, key), key)
g, = torch.autograd.grad(ma.undispatch(out, key).pow(2).sum(), q, create_graph=True)
try:
    torch.autograd.grad(g.pow(2).sum() + q.sum(), q)
except RuntimeError as e:
    assert "attention gradients are not differentiable" in str(e), e
else:
    raise AssertionError("a double backward through calc_attn passed")
dist.barrier()  # every rank passed (a failing one ends torchrun with an error)
if dist.get_rank() == 0:
    print("edges ok")
ma.clear_cache()
dist.destroy_process_group()
"""


def test_argument_ranges_and_double_backward(tmp_path):
    """Ints past int32 / int64 (key options, roll's shift), create_graph through dispatch, roll, calc_attn, and
    complex tensors (gradients, conj views) through dispatch, roll, undispatch."""
    script = tmp_path / "edges.py"
    script.write_text(EDGES)
    env = {k: v for k, v in os.environ.items() if k != "MAGI_TEST_DIST_BACKEND"}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                             f"--master-port={_free_port()}", str(script)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "edges ok" in result.stdout, result.stdout + result.stderr[-3000:]


def test_clear_cache_names_a_bad_group():
    import magi_attn as ma

    with pytest.raises(TypeError, match="cp_group: expected a torch.distributed.ProcessGroup or None, got int"):
        ma.clear_cache(5)
    ma.clear_cache()  # none: every group's (nothing here)


def test_init_distributed_without_a_launcher_is_an_error():
    code = "import magi_attn as ma\ntry:\n    ma.init_distributed()\nexcept ValueError as e:\n    print('ValueError:', e)"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
    assert "ValueError: init_distributed: no launcher variables" in out and "torchrun" in out
