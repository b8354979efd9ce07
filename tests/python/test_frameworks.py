"""Arrays of every framework in, arrays of the same framework and device out, zero-copy: JAX and torch through
ma.forward / ma.backward (numpy: test_numpy.py), CuPy and JAX on GPUs where the machine has them."""
from __future__ import annotations

import numpy as np
import pytest

import magi_attn as ma
import reference as ref
from conftest import random_rectangles


def _case(rng, total_q=300, total_k=260):
    mask = random_rectangles(rng, total_q, total_k, 10)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in
              ((total_q, 4, 32), (total_k, 2, 32), (total_k, 2, 32), (total_q, 4, 32))]
    keep = ref.keep_matrix(mask.q_ranges, mask.k_ranges, mask.attn_type_map, total_q, total_k)
    return mask, arrays, keep


def _check(mask, arrays, keep, convert, back, kind, dtype="fp32"):
    q, k, v, do = (convert(a) for a in arrays)
    out, lse = ma.forward(mask, q, k, v)
    assert type(out).__module__.split(".")[0] == kind and type(lse).__module__.split(".")[0] == kind
    dq, dk, dv = ma.backward(mask, q, k, v, out, lse, do)
    assert type(dq).__module__.split(".")[0] == kind
    host = [np.asarray(back(x), dtype=np.float64) for x in (q, k, v, do)]
    out_ref, lse_ref, _ = ref.forward(*host[:3], keep)
    ref.assert_close("out", back(out), out_ref, dtype)
    ref.assert_lse(back(lse), lse_ref, dtype)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref.backward(*host, keep)):
        ref.assert_close(name, back(got), want, dtype, grad=True)


def test_jax_cpu_arrays(rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    cpu = jax.devices("cpu")[0]  # JAX puts new arrays on a GPU where it has one
    mask, arrays, keep = _case(rng)
    _check(mask, arrays, keep, lambda a: jax.device_put(a, cpu), lambda x: np.asarray(x, dtype=np.float64), "jaxlib")
    # bf16 through the CPU engine's emulation
    _check(mask, arrays, keep, lambda a: jax.device_put(a, cpu).astype(jnp.bfloat16),
           lambda x: np.asarray(x.astype(jnp.float32), dtype=np.float64), "jaxlib", "bf16")


def test_torch_cpu_tensors_through_the_neutral_api(rng):
    torch = pytest.importorskip("torch")
    mask, arrays, keep = _case(rng)
    _check(mask, arrays, keep, torch.from_numpy, lambda x: x.double().numpy(), "torch")
    q = torch.from_numpy(arrays[0]).requires_grad_()  # tensors needing grad are read, not differentiated
    out, _ = ma.forward(mask, q, *(torch.from_numpy(a) for a in arrays[1:3]))
    assert not out.requires_grad


def test_no_copy_of_inputs(rng):
    torch = pytest.importorskip("torch")
    mask = ma.masks.full(16)
    q = torch.randn(16, 1, 8, dtype=torch.float64)
    out1, _ = ma.forward(mask, q, q, q)
    q.mul_(2.0)  # the library reads the caller's memory: the change shows
    out2, _ = ma.forward(mask, q, q, q)
    assert not torch.equal(out1, out2)


def _gpu_frameworks():
    found = []
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0 and ma.build_info()["cuda"]:
            found.append("cupy")
    except Exception:
        pass
    try:
        import jax
        if any(d.platform == "gpu" for d in jax.devices()) and ma.build_info()["cuda"]:
            found.append("jax")
    except Exception:
        pass
    return found


@pytest.mark.parametrize("kind", _gpu_frameworks() or [pytest.param("none", marks=pytest.mark.skip(
    reason="no CuPy / JAX GPU here (runs on the GPU machine)"))])
def test_gpu_arrays_of_other_frameworks(rng, kind):
    mask, arrays, keep = _case(rng, 1024, 768)
    if kind == "cupy":
        import cupy
        convert = lambda a: cupy.asarray(a.astype(np.float16))  # noqa: E731
        back = lambda x: cupy.asnumpy(x).astype(np.float64)  # noqa: E731
        _check(mask, arrays, keep, convert, back, "cupy", "fp16")
    else:
        import jax
        import jax.numpy as jnp
        gpu = [d for d in jax.devices() if d.platform == "gpu"][0]
        convert = lambda a: jax.device_put(jnp.asarray(a, dtype=jnp.bfloat16), gpu)  # noqa: E731
        back = lambda x: np.asarray(x.astype(jnp.float32), dtype=np.float64)  # noqa: E731
        _check(mask, arrays, keep, convert, back, "jaxlib", "bf16")
