"""ma.forward / ma.backward on numpy arrays (the CPU engine) against the fp64 reference: every case of SPEC
section 7, random slice masks, every option; fp64 and fp32 by the SPEC section 5 rules."""
from __future__ import annotations

import numpy as np
import pytest

import magi_attn as ma
import reference as ref
from conftest import random_rectangles

NP = {"fp64": np.float64, "fp32": np.float32, "fp16": np.float16}


def inputs(rng, tq, tk, hq, hkv, d, dtype):
    make = lambda *shape: rng.standard_normal(shape).astype(NP[dtype])  # noqa: E731
    return make(tq, hq, d), make(tk, hkv, d), make(tk, hkv, d), make(tq, hq, d)


def check(mask, rng, dtype="fp64", heads=(2, 1), d=64, softcap=0.0, scale=None, sink_layout=None, sinks=2,
          backward=True, max_logits=False):
    """One forward (+ backward) through ma on numpy against the reference; returns the results."""
    hq, hkv = heads
    q, k, v, do = inputs(rng, mask.total_q, mask.total_k, hq, hkv, d, dtype)
    sink = None
    if sink_layout == "sh":
        sink = rng.standard_normal((sinks, hq)).astype(np.float32)
    elif sink_layout == "ssh":
        sink = rng.standard_normal((mask.total_q, sinks, hq)).astype(np.float32)
    keep = ref.keep_matrix(mask.q_ranges, mask.k_ranges, mask.attn_type_map.tolist(), mask.total_q, mask.total_k)
    out_ref, lse_ref, max_ref = ref.forward(q, k, v, keep, scale, softcap, sink, sink_layout or "sh")
    results = ma.forward(mask, q, k, v, softmax_scale=scale, softcap=softcap, sink=sink,
                         sink_layout=sink_layout or "sh", return_max_logits=max_logits)
    out, lse = results[:2]
    assert isinstance(out, np.ndarray) and out.dtype == NP[dtype] and out.shape == q.shape
    assert lse.dtype == (np.float64 if dtype == "fp64" else np.float32) and lse.shape == q.shape[:2]
    ref.assert_close("out", out, out_ref, dtype)
    ref.assert_lse(lse, lse_ref, dtype)
    if max_logits:
        np.testing.assert_allclose(results[2], max_ref.astype(np.float32), rtol=1e-5, atol=1e-5)
    if not backward:
        return results
    grads = ma.backward(mask, q, k, v, out, lse, do, softmax_scale=scale, softcap=softcap, sink=sink,
                        sink_layout=sink_layout or "sh")
    dq_ref, dk_ref, dv_ref, dsink_ref = ref.backward(q, k, v, do, keep, scale, softcap, sink, sink_layout or "sh")
    for name, got, want in zip(("dq", "dk", "dv"), grads, (dq_ref, dk_ref, dv_ref)):
        assert got.dtype == NP[dtype]
        ref.assert_close(name, got, want, dtype, grad=True)
    if sink is not None:
        assert len(grads) == 4 and grads[3].dtype == np.float32 and grads[3].shape == sink.shape
        ref.assert_close("dsink", grads[3], dsink_ref, "fp32", grad=True)
    else:
        assert len(grads) == 3
    return results, grads


# ---- SPEC section 7 ----


@pytest.mark.parametrize("dtype", ["fp64", "fp32"])
def test_full_4k_with_ssh_sink(rng, dtype):
    check(ma.masks.full(4096, 4096), rng, dtype, heads=(1, 1), d=32, sink_layout="ssh")


def _uneven_docs(rng, total, docs):
    cuts = np.sort(rng.choice(np.arange(1, total), docs - 1, replace=False))
    return [0, *cuts.tolist(), total]


@pytest.mark.parametrize("dtype", ["fp64", "fp32"])
def test_varlen_full_ten_uneven_documents(rng, dtype):
    check(ma.masks.varlen_full(_uneven_docs(rng, 3000, 10)), rng, dtype)


@pytest.mark.parametrize("q_block", [256, 512])
def test_block_causal_2k(rng, q_block):
    # q blocks, each keeping the k prefix up to its end
    starts = range(0, 2048, q_block)
    mask = ma.Mask([[s, s + q_block] for s in starts], [[0, s + q_block] for s in starts], "full")
    assert mask == ma.masks.block_causal(2048, q_block)
    check(mask, rng, "fp64")


def test_varlen_block_causal(rng):
    check(ma.masks.varlen_block_causal(_uneven_docs(rng, 2500, 6), 128), rng, "fp32")


def test_sparse_2k_fourteen_slices_with_repeated_q_ranges(rng):
    q_ranges = [[0, 256]] * 4 + [[256, 768]] * 5 + [[768, 2048]] * 5
    k_ranges = [[0, 128], [128, 512], [600, 700], [1500, 2048],
                [0, 300], [300, 400], [400, 800], [900, 1200], [1800, 2048],
                [0, 512], [512, 768], [768, 1024], [1024, 1536], [1536, 2048]]
    types = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 0, 3, 2, 1]
    check(ma.Mask(q_ranges, k_ranges, types), rng, "fp64", heads=(4, 2))


def test_disjoint_ranges_leave_rows_uncovered(rng):
    mask = ma.Mask([[0, 300], [700, 900]], [[100, 600], [0, 1000]], ["full", "causal"], total_q=1200, total_k=1000)
    (out, lse), grads = check(mask, rng, "fp64")
    assert np.isneginf(lse[300:700]).all() and np.isneginf(lse[900:]).all()
    assert (out[300:700] == 0).all() and (grads[0][300:700] == 0).all()


def test_many_slices_sharing_one_k_range(rng):
    mask = ma.Mask([[i * 64, (i + 1) * 64] for i in range(24)], [[256, 1280]] * 24, [i % 4 for i in range(24)],
                   total_k=1536)
    check(mask, rng, "fp32")


def test_grid_of_50_token_slices_alternating_full_and_causal(rng):
    cells = [(r, c) for r in range(50) for c in range(50)]
    mask = ma.Mask([[50 * r, 50 * (r + 1)] for r, c in cells], [[50 * c, 50 * (c + 1)] for r, c in cells],
                   [(r + c) % 2 for r, c in cells])
    assert len(mask) == 2500
    check(mask, rng, "fp32", heads=(1, 1), d=32)


@pytest.mark.parametrize("tq,tk", [(1024, 1024), (2048, 2048), (2048, 4096), (4096, 2048)])
@pytest.mark.parametrize("slices", [10, 100, 1000])
def test_random_rectangles_of_every_type(rng, tq, tk, slices):
    mask = random_rectangles(rng, tq, tk, slices)
    dtype = "fp64" if slices == 100 else "fp32"
    check(mask, rng, dtype, heads=(1, 1), d=32, backward=tq * tk <= 4 * 1024 * 1024)


@pytest.mark.parametrize("heads,d", [((8, 8), 128), ((32, 4), 128), ((1, 1), 64), ((4, 2), 64)])
def test_head_shapes(rng, heads, d):
    check(random_rectangles(rng, 384, 320, 12), rng, "fp32", heads=heads, d=d)


@pytest.mark.parametrize("kind", ["causal", "bi_causal"])
def test_more_queries_than_keys_leaves_empty_rows(rng, kind):
    mask = ma.Mask([[0, 700]], [[100, 400]], kind, total_k=500)
    (out, lse), _ = check(mask, rng, "fp64")
    assert np.isneginf(lse[:400]).all()  # causal: row i keeps j <= i - 400 (bottom-right aligned)


@pytest.mark.parametrize("sink_layout", [None, "sh", "ssh"])
def test_sequences_without_tokens(rng, sink_layout):
    """No keys: every row is empty (out 0, lse -inf, or the sink's log-sum-exp); no queries: zero dk / dv."""
    for tq, tk in ((5, 0), (0, 7), (0, 0)):
        mask = ma.Mask(np.zeros((0, 2), np.int32), np.zeros((0, 2), np.int32), [], total_q=tq, total_k=tk)
        q, k, v, do = inputs(rng, tq, tk, 2, 1, 16, "fp64")
        sink = None
        if sink_layout is not None:
            sink = rng.standard_normal((3, 2) if sink_layout == "sh" else (tq, 3, 2)).astype(np.float32)
        out, lse = ma.forward(mask, q, k, v, sink=sink, sink_layout=sink_layout or "sh")
        assert out.shape == (tq, 2, 16) and lse.shape == (tq, 2)
        assert (out == 0).all()
        if sink is None:
            assert np.isneginf(lse).all()
        else:
            want = np.logaddexp.reduce(sink.astype(np.float64), axis=-2)
            np.testing.assert_allclose(lse, np.broadcast_to(want, lse.shape), rtol=1e-6)
        grads = ma.backward(mask, q, k, v, out, lse, do, sink=sink, sink_layout=sink_layout or "sh")
        assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
        assert all((g == 0).all() for g in grads)


# ---- options ----


def test_softcap_scale_and_max_logits(rng):
    check(random_rectangles(rng, 600, 500, 20), rng, "fp64", softcap=5.0, scale=0.3, max_logits=True)


@pytest.mark.parametrize("layout", ["sh", "ssh"])
def test_sink_layouts(rng, layout):
    mask = ma.Mask([[0, 200], [300, 500]], [[0, 300], [0, 500]], ["causal", "full"], total_q=600, total_k=500)
    check(mask, rng, "fp64", sink_layout=layout, sinks=3)


def test_gqa_and_fp16_inputs(rng):
    check(ma.masks.varlen_causal([0, 100, 700, 1000]), rng, "fp16", heads=(6, 2))


def test_fp32_output_and_gradient_dtypes(rng):
    mask = ma.masks.causal(256)
    q, k, v, do = inputs(rng, 256, 256, 2, 2, 64, "fp16")
    out, lse = ma.forward(mask, q, k, v, out_dtype="float32")
    assert out.dtype == np.float32
    dq, dk, dv = ma.backward(mask, q, k, v, out, lse, do.astype(np.float32), grad_dtype=np.float32)
    assert dq.dtype == dk.dtype == dv.dtype == np.float32
    keep = ref.keep_matrix(mask.q_ranges, mask.k_ranges, mask.attn_type_map, 256, 256)
    ref.assert_close("dq", dq, ref.backward(q, k, v, do.astype(np.float32), keep)[0], "fp16", grad=True)


def test_reference_backend_and_deterministic_flag(rng):
    mask = random_rectangles(rng, 300, 300, 9)
    q, k, v, _ = inputs(rng, 300, 300, 2, 1, 64, "fp32")
    a = ma.forward(mask, q, k, v, backend="reference")
    b = ma.forward(mask, q, k, v, backend="cpu", deterministic=True)
    keep = ref.keep_matrix(mask.q_ranges, mask.k_ranges, mask.attn_type_map, 300, 300)
    out_ref, _, _ = ref.forward(q, k, v, keep)
    ref.assert_close("out (reference)", a[0], out_ref, "fp32")
    ref.assert_close("out (cpu)", b[0], out_ref, "fp32")
    c = ma.forward(mask, q, k, v, backend="cpu", deterministic=True)
    assert (b[0] == c[0]).all() and (b[1] == c[1]).all()  # bitwise


def test_read_only_inputs_are_accepted(rng):
    mask = ma.masks.full(64)
    q, k, v, _ = inputs(rng, 64, 64, 1, 1, 16, "fp64")
    for x in (q, k, v):
        x.flags.writeable = False
    out, _ = ma.forward(mask, q, k, v)
    ref.assert_close("out", out, ref.forward(q, k, v, np.ones((64, 64), bool))[0], "fp64")


# ---- bad input: the exception type and a message naming the argument and the allowed values ----

BAD = [
    ("q is a list", lambda q, k, v, m: ma.forward(m, q.tolist(), k, v), TypeError, "q: expected an array"),
    ("v is a numpy scalar", lambda q, k, v, m: ma.forward(m, q, k, v[0, 0, 0]), TypeError,
     "v: expected an array (numpy, torch, JAX, CuPy or any DLPack producer), got numpy.float64"),
    ("mask is not a Mask", lambda q, k, v, m: ma.forward("causal", q, k, v), TypeError, "mask: expected a magi_attn.Mask"),
    ("int dtype", lambda q, k, v, m: ma.forward(m, q.astype(np.int32), k, v), ValueError, "q: unknown dtype"),
    ("mixed dtypes", lambda q, k, v, m: ma.forward(m, q, k.astype(np.float32), v), ValueError, "dtype must equal q's"),
    ("strided q", lambda q, k, v, m: ma.forward(m, np.repeat(q, 2, axis=2)[:, :, ::2], k, v), ValueError,
     "row-major contiguous"),
    ("head dim", lambda q, k, v, m: ma.forward(m, q[:, :, :12].copy(), k[:, :, :12].copy(), v[:, :, :12].copy()),
     ValueError, "multiple of 8"),
    ("heads", lambda q, k, v, m: ma.forward(m, q, np.concatenate([k] * 3, 1), np.concatenate([v] * 3, 1)),
     ValueError, "must be a multiple of Hkv"),
    ("2-D q", lambda q, k, v, m: ma.forward(m, q[:, 0], k, v), ValueError, "q: expected shape [Tq, Hq, D]"),
    ("zero head dim", lambda q, k, v, m: ma.forward(m, q[:, :, :0].copy(), k[:, :, :0].copy(), v[:, :, :0].copy()),
     ValueError, "head dim D must be a positive multiple of 8, got 0"),
    ("no heads", lambda q, k, v, m: ma.forward(m, q[:, :0].copy(), k[:, :0].copy(), v[:, :0].copy()), ValueError,
     "head counts must be positive"),
    ("no sink tokens", lambda q, k, v, m: ma.forward(m, q, k, v, sink=np.zeros((0, 2), np.float32)), ValueError,
     "sink tokens S must be >= 1"),
    ("token count vs mask", lambda q, k, v, m: ma.forward(m, q[:-1].copy(), k, v), ValueError, "mask: total_q x total_k"),
    ("sink layout", lambda q, k, v, m: ma.forward(m, q, k, v, sink=np.zeros((1, 2), np.float32), sink_layout="hs"),
     ValueError, "sink_layout"),
    ("sink shape", lambda q, k, v, m: ma.forward(m, q, k, v, sink=np.zeros((1, 3), np.float32)), ValueError, "sink"),
    ("sink dtype", lambda q, k, v, m: ma.forward(m, q, k, v, sink=np.zeros((1, 2), np.float64)), ValueError,
     "sink: dtype fp64 is not allowed here (allowed: fp32)"),
    ("softcap", lambda q, k, v, m: ma.forward(m, q, k, v, softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
    ("softcap type", lambda q, k, v, m: ma.forward(m, q, k, v, softcap="big"), TypeError, "softcap"),
    ("scale", lambda q, k, v, m: ma.forward(m, q, k, v, softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ("scale past fp32", lambda q, k, v, m: ma.forward(m, q, k, v, softmax_scale=1e39), ValueError,
     "softmax_scale must be finite and at most 3.4e38"),
    ("backend", lambda q, k, v, m: ma.forward(m, q, k, v, backend="fast"), ValueError, "backend"),
    ("cuda backend on host", lambda q, k, v, m: ma.forward(m, q, k, v, backend="cuda"), ValueError,
     "backend cuda needs CUDA device tensors"),
    ("out dtype", lambda q, k, v, m: ma.forward(m, q, k, v, out_dtype="fp16"), ValueError, "out_dtype"),
    ("deterministic type", lambda q, k, v, m: ma.forward(m, q, k, v, deterministic=1), TypeError, "deterministic"),
    ("backward do shape", lambda q, k, v, m: ma.backward(m, q, k, v, q, np.zeros(q.shape[:2]), q[:-1].copy()),
     ValueError, "do: expected shape [Tq, Hq, D]"),
    ("backward do dtype", lambda q, k, v, m: ma.backward(m, q, k, v, q, np.zeros(q.shape[:2]), q.astype(np.float16)),
     ValueError, "do: dtype fp16 is not allowed here"),
    ("backward do dtype, fp32 q", lambda q, k, v, m: ma.backward(m, *(x.astype(np.float32) for x in (q, k, v, q)),
                                                                   np.zeros(q.shape[:2], np.float32), q),
     ValueError, "do: dtype fp64 is not allowed here (allowed: fp32)"),
    # Broadcast views (stride 0) of a huge virtual shape: the layout error, not a MemoryError from allocating an
    # output of that shape first.
    ("broadcast q", lambda q, k, v, m: ma.forward(m, np.broadcast_to(q[:1], (2**31 - 1, 2, 16)), k, v), ValueError,
     "q: must be row-major contiguous"),
    ("broadcast k, backward", lambda q, k, v, m: ma.backward(m, q, np.broadcast_to(k[:1], (2**31 - 1, 1, 16)), v, q,
                                                             np.zeros(q.shape[:2]), q), ValueError,
     "k: must be row-major contiguous"),
    ("broadcast sink, backward", lambda q, k, v, m: ma.backward(m, q, k, v, q, np.zeros(q.shape[:2]), q,
                                                                sink=np.broadcast_to(np.float32(0), (2**40, 2))),
     ValueError, "sink: must be row-major contiguous"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_naming_the_argument(rng, case):
    _, call, error, message = case
    mask = ma.masks.causal(64)
    q, k, v, _ = inputs(rng, 64, 64, 2, 1, 16, "fp64")
    with pytest.raises(error) as info:
        call(q, k, v, mask)
    assert message in str(info.value), str(info.value)


def test_out_dtype_as_a_scalar_type_of_another_framework(rng):
    """out_dtype=jax.numpy.float32 (a scalar type, printed "<class 'jax.numpy.float32'>") was an unknown dtype."""
    mask = ma.masks.causal(16)
    q, k, v, _ = inputs(rng, 16, 16, 2, 1, 8, "fp64")
    jnp_float32 = type("float32", (), {"__module__": "jax.numpy"})
    out, _ = ma.forward(mask, q, k, v, out_dtype=jnp_float32)
    assert out.dtype == np.float32
    with pytest.raises(ValueError, match="out_dtype: unknown dtype"):
        ma.forward(mask, q, k, v, out_dtype=type("int32", (), {"__module__": "jax.numpy"}))


def test_omp_num_threads_past_the_limit_is_capped():
    """OMP_NUM_THREADS=100000 crashed OpenMP's runtime; the CPU engine's default team is capped at 1024."""
    import os
    import subprocess
    import sys
    code = ("import numpy as np, magi_attn as ma; x = np.ones((16, 1, 8), np.float32); "
            "print(float(ma.forward(ma.masks.causal(16), x, x, x)[0].sum()))")
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, OMP_NUM_THREADS="100000"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "128.0", done.stdout + done.stderr
