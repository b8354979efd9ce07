"""The torch layer: flex_flash_attn_func (custom ops magi_attn::flex_fwd / flex_bwd) against the fp64 reference,
autograd and gradcheck, the ops' registration (opcheck: schema, fake tensors, autograd), torch.compile with
fullgraph, the plan cache over range tensors, bad input; on GPUs also bf16 / fp16, streams and CUDA graphs."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # CI installs torch (README): this runs there

import magi_attn as ma  # noqa: E402
import reference as ref  # noqa: E402
from conftest import random_rectangles  # noqa: E402
from magi_attn import torch_ops  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TORCH = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def ranges(mask: ma.Mask, device):
    return tuple(torch.from_numpy(a).to(device) for a in (mask.q_ranges, mask.k_ranges, mask.attn_type_map))


def make(rng, mask, hq, hkv, d, dtype, device, sink_layout=None):
    t = lambda *s: torch.from_numpy(rng.standard_normal(s)).to(device=device, dtype=TORCH[dtype])  # noqa: E731
    q, k, v = t(mask.total_q, hq, d), t(mask.total_k, hkv, d), t(mask.total_k, hkv, d)
    sink = None
    if sink_layout == "sh":
        sink = torch.from_numpy(rng.standard_normal((2, hq))).float().to(device)
    elif sink_layout == "ssh":
        sink = torch.from_numpy(rng.standard_normal((mask.total_q, 2, hq))).float().to(device)
    return q, k, v, sink


def fast_dtypes(device):
    return ["fp64", "fp32"] if device == "cpu" else ["bf16", "fp16"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sink_layout", [None, "sh", "ssh"])
def test_forward_and_autograd_match_reference(rng, device, sink_layout):
    for dtype in fast_dtypes(device):
        mask = random_rectangles(rng, 520, 400, 15)
        q, k, v, sink = make(rng, mask, 4, 2, 64, dtype, device, sink_layout)
        leaves = [x.requires_grad_() for x in (q, k, v)] + ([sink.requires_grad_()] if sink is not None else [])
        softcap = 8.0 if sink_layout == "sh" else 0.0
        out, lse = ma.flex_flash_attn_func(q, k, v, *ranges(mask, device), softcap=softcap, sink=sink,
                                           sink_layout=sink_layout or "sh")
        assert out.dtype == q.dtype and out.device == q.device and lse.dtype == (
            torch.float64 if dtype == "fp64" else torch.float32)
        do = torch.from_numpy(rng.standard_normal(out.shape)).to(out)
        out.backward(do)
        keep = ref.keep_matrix(mask.q_ranges, mask.k_ranges, mask.attn_type_map, mask.total_q, mask.total_k)
        host = lambda x: x.detach().double().cpu().numpy()  # noqa: E731
        args = (host(q), host(k), host(v))
        sink_np = None if sink is None else host(sink)
        out_ref, lse_ref, _ = ref.forward(*args, keep, None, softcap, sink_np, sink_layout or "sh")
        ref.assert_close("out", host(out), out_ref, dtype)
        ref.assert_lse(host(lse), lse_ref, dtype)
        grads = ref.backward(*args, host(do), keep, None, softcap, sink_np, sink_layout or "sh")
        for name, leaf, want in zip(("dq", "dk", "dv", "dsink"), leaves, grads):
            # dsink is fp32, computed from the inputs' precision
            tol = dtype if name != "dsink" or dtype in ("bf16", "fp16") else "fp32"
            ref.assert_close(name, host(leaf.grad), want, tol, grad=True)


def large_dim_devices(d):
    tiles = ma.build_info()["cuda_head_dim_tiles"]
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() and any(t >= d for t in tiles) else [])


# Head dims above 256 (the D-split kernels on GPUs, where this build has the tile; any D on the CPU), forward and
# autograd: D 264, 376, 520 and 760 run padded in the next larger tile.
@pytest.mark.parametrize("d", [264, 376, 520, 760, 1024])
def test_large_head_dims_match_reference(rng, d):
    for device in large_dim_devices(d):
        dtype = "fp32" if device == "cpu" else "bf16"
        mask = random_rectangles(rng, 160, 130, 6)
        q, k, v, _ = make(rng, mask, 2, 1, d, dtype, device)
        for x in (q, k, v):
            x.requires_grad_()
        out, lse = ma.flex_flash_attn_func(q, k, v, *ranges(mask, device))
        do = torch.from_numpy(rng.standard_normal(out.shape)).to(out)
        out.backward(do)
        keep = ref.keep_matrix(mask.q_ranges, mask.k_ranges, mask.attn_type_map, mask.total_q, mask.total_k)
        host = lambda x: x.detach().double().cpu().numpy()  # noqa: E731
        args = (host(q), host(k), host(v))
        out_ref, lse_ref, _ = ref.forward(*args, keep, None, 0.0, None, "sh")
        ref.assert_close("out", host(out), out_ref, dtype)
        ref.assert_lse(host(lse), lse_ref, dtype)
        grads = ref.backward(*args, host(do), keep, None, 0.0, None, "sh")
        for name, leaf, want in zip(("dq", "dk", "dv"), (q, k, v), grads):
            ref.assert_close(name, host(leaf.grad), want, dtype, grad=True)


def test_gradcheck_fp64():
    mask = ma.Mask([[0, 12], [12, 24], [4, 20]], [[0, 10], [6, 20], [20, 24]], ["causal", "bi_causal", "full"])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(24, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(24, 1, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(24, 1, 8, dtype=torch.float64, generator=g, requires_grad=True)
    sink = torch.randn(2, 2, dtype=torch.float32, generator=g)
    qr, kr, tm = ranges(mask, "cpu")
    fn = lambda q, k, v: ma.flex_flash_attn_func(q, k, v, qr, kr, tm, softcap=3.0)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7)
    fn_sink = lambda q, k, v: ma.flex_flash_attn_func(q, k, v, qr, kr, tm, sink=sink)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn_sink, (q, k, v), eps=1e-6, atol=1e-7)


def test_sink_gradient_by_finite_differences():
    mask = ma.masks.causal(16)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(16, 2, 8, dtype=torch.float64, generator=g) for _ in range(3))
    sink = torch.randn(3, 2, dtype=torch.float32, generator=g, requires_grad=True)
    out, _ = ma.flex_flash_attn_func(q, k, v, *ranges(mask, "cpu"), sink=sink)
    w = torch.randn(out.shape, dtype=torch.float64, generator=g)
    (out * w).sum().backward()
    eps = 1e-2
    for s, h in [(0, 0), (2, 1)]:
        def loss(delta):
            moved = sink.detach().clone()
            moved[s, h] += delta
            return float((ma.flex_flash_attn_func(q, k, v, *ranges(mask, "cpu"), sink=moved)[0] * w).sum())
        numeric = (loss(eps) - loss(-eps)) / (2 * eps)
        assert abs(float(sink.grad[s, h]) - numeric) <= 1e-3 * max(1.0, abs(numeric))


def test_ops_registration_opcheck():
    mask = ma.masks.varlen_causal([0, 5, 16])
    qr, kr, tm = ranges(mask, "cpu")
    q, k, v = (torch.randn(16, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    torch.library.opcheck(torch_ops.flex_fwd, (q, k, v, qr, kr, tm, None, 0.3, 0.0, "sh", None, False, True))
    out, lse, _ = torch_ops.flex_fwd(q, k, v, qr, kr, tm, None, 0.3, 0.0, "sh", None, False, False)
    do = torch.randn_like(out)
    torch.library.opcheck(torch_ops.flex_bwd, (do, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                                                qr, kr, tm, None, 0.3, 0.0, "sh", None))


class Block(torch.nn.Module):
    """Attention + MLP over packed documents (the examples' block)."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x, q_ranges, k_ranges, types):
        t, dim = x.shape
        q, k, v = self.qkv(x).view(t, 3, self.heads, dim // self.heads).unbind(1)
        out, _ = ma.flex_flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), q_ranges, k_ranges, types)
        return x + self.proj(out.reshape(t, dim))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_matches_eager(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    mask = ma.masks.varlen_block_causal([0, 40, 100, 128], 16)
    qr, kr, tm = ranges(mask, device)
    block = Block().to(device=device, dtype=dtype)
    x = torch.randn(128, 32, device=device, dtype=dtype, requires_grad=True)
    eager = block(x, qr, kr, tm)
    eager.sum().backward()
    grad_eager = x.grad.clone()
    x.grad = None
    compiled = torch.compile(block, fullgraph=True)
    y = compiled(x, qr, kr, tm)
    y.sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, eager, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad, grad_eager, rtol=tol, atol=tol)


def test_range_tensors_changed_in_place_are_noticed(rng):
    mask = ma.masks.full(32)
    q, k, v, _ = make(rng, mask, 1, 1, 8, "fp64", "cpu")
    qr, kr, tm = ranges(mask, "cpu")
    a, _ = ma.flex_flash_attn_func(q, k, v, qr, kr, tm)
    tm[0] = 1  # now causal: the cached plan must not be reused
    b, _ = ma.flex_flash_attn_func(q, k, v, qr, kr, tm)
    keep = np.tril(np.ones((32, 32), bool))
    ref.assert_close("out", b.numpy(), ref.forward(q.numpy(), k.numpy(), v.numpy(), keep)[0], "fp64")
    assert not torch.equal(a, b)
    tm.data[0] = 0  # back to full, by a write torch's version counter does not see: CPU ranges are read anew
    c, _ = ma.flex_flash_attn_func(q, k, v, qr, kr, tm)
    ref.assert_close("out", c.numpy(), ref.forward(q.numpy(), k.numpy(), v.numpy(), np.ones((32, 32), bool))[0], "fp64")


def test_inputs_of_two_frameworks(rng):
    """q from torch, k and v from numpy (and the other way round): read through DLPack alike, out in q's framework."""
    mask = ma.masks.causal(24)
    q, k, v, _ = make(rng, mask, 2, 1, 8, "fp64", "cpu")
    want = ref.forward(q.numpy(), k.numpy(), v.numpy(), np.tril(np.ones((24, 24), bool)))[0]
    out, _ = ma.forward(mask, q, k.numpy(), v.numpy())
    assert isinstance(out, torch.Tensor)
    ref.assert_close("out", out.numpy(), want, "fp64")
    out, _ = ma.forward(mask, q.numpy(), k, v)
    assert isinstance(out, np.ndarray)
    ref.assert_close("out", out, want, "fp64")


def test_max_logits_and_fp32_output(rng):
    mask = random_rectangles(rng, 200, 150, 8)
    q, k, v, _ = make(rng, mask, 3, 1, 16, "fp32", "cpu")
    out, lse, max_logits = ma.flex_flash_attn_func(q, k, v, *ranges(mask, "cpu"), out_type=torch.float32,
                                                   return_max_logits=True, softmax_scale=0.5)
    keep = ref.keep_matrix(mask.q_ranges, mask.k_ranges, mask.attn_type_map, 200, 150)
    _, _, want = ref.forward(q.double().numpy(), k.double().numpy(), v.double().numpy(), keep, 0.5)
    np.testing.assert_allclose(max_logits.numpy(), want, rtol=1e-5, atol=1e-5)


BAD = [
    ("q not a tensor", lambda q, k, v, r: ma.flex_flash_attn_func(q.numpy(), k, v, *r), TypeError, "q: expected a torch.Tensor"),
    ("int64 ranges", lambda q, k, v, r: ma.flex_flash_attn_func(q, k, v, r[0].long(), r[1], r[2]), TypeError,
     "q_ranges: expected an int32 tensor"),
    ("range shape", lambda q, k, v, r: ma.flex_flash_attn_func(q, k, v, r[0][:, :1].contiguous(), r[1], r[2]),
     ValueError, "q_ranges: expected shape [n, 2]"),
    ("type count", lambda q, k, v, r: ma.flex_flash_attn_func(q, k, v, r[0], r[1], r[2][:0]), ValueError,
     "attn_type_map: expected shape [n]"),
    ("type value", lambda q, k, v, r: ma.flex_flash_attn_func(q, k, v, r[0], r[1], r[2] + 7), ValueError,
     "unknown mask type"),
    ("range outside", lambda q, k, v, r: ma.flex_flash_attn_func(q, k, v, r[0] + 5, r[1], r[2]), ValueError, "slice 0"),
    ("non-contiguous q", lambda q, k, v, r: ma.flex_flash_attn_func(q.transpose(0, 1).contiguous().transpose(0, 1),
                                                                    k, v, *r), ValueError, "row-major contiguous"),
    ("out_type", lambda q, k, v, r: ma.flex_flash_attn_func(q, k, v, *r, out_type=torch.float16), ValueError, "out_type"),
    ("sink layout", lambda q, k, v, r: ma.flex_flash_attn_func(q, k, v, *r, sink=torch.zeros(1, 2), sink_layout="x"),
     ValueError, "sink_layout"),
    ("sink dtype", lambda q, k, v, r: ma.flex_flash_attn_func(q, k, v, *r, sink=torch.zeros(1, 2, dtype=torch.float64)),
     ValueError, "sink: dtype fp64"),
    ("dtype", lambda q, k, v, r: ma.flex_flash_attn_func(q.int(), k.int(), v.int(), *r), ValueError,
     "q: dtype torch.int32 is not supported"),
    ("softcap None", lambda q, k, v, r: ma.flex_flash_attn_func(q, k, v, *r, softcap=None), TypeError,
     "softcap: expected a number"),
    ("scale text", lambda q, k, v, r: ma.flex_flash_attn_func(q, k, v, *r, softmax_scale="a"), TypeError,
     "softmax_scale: expected a number or None"),
    ("meta device", lambda q, k, v, r: ma.flex_flash_attn_func(q.to("meta"), k.to("meta"), v.to("meta"), *r),
     ValueError, "q: tensors on meta are not supported"),
    ("meta sink", lambda q, k, v, r: ma.flex_flash_attn_func(q, k, v, *r, sink=torch.zeros(1, 2, device="meta")),
     ValueError, "sink: tensors on meta are not supported"),
    ("meta types", lambda q, k, v, r: ma.flex_flash_attn_func(q, k, v, r[0], r[1], r[2].to("meta")), ValueError,
     "attn_type_map: tensors on meta are not supported"),
    ("0-d k", lambda q, k, v, r: ma.flex_flash_attn_func(q, k[0, 0, 0], v, *r), ValueError,
     "k: expected shape [Tk, Hkv, D]"),
    ("0-d ranges", lambda q, k, v, r: ma.flex_flash_attn_func(q, k, v, r[0][0, 0], r[1]), ValueError,
     "q_ranges: expected shape [n, 2]"),
    ("head dim 0", lambda q, k, v, r: ma.flex_flash_attn_func(q[..., :0], k[..., :0], v[..., :0], *r), ValueError,
     "head dim D must be a positive multiple of 8"),
    ("softcap past fp32", lambda q, k, v, r: ma.flex_flash_attn_func(q, k, v, *r, softcap=4e38), ValueError,
     "softcap must be finite"),
    ("scale past double", lambda q, k, v, r: ma.flex_flash_attn_func(q, k, v, *r, softmax_scale=10**400), ValueError,
     "softmax_scale: too large"),
    ("max_logits text", lambda q, k, v, r: ma.flex_flash_attn_func(q, k, v, *r, return_max_logits="no"), TypeError,
     "return_max_logits: expected a bool"),
    # An expanded (stride 0) q of a huge virtual shape: the layout error, not out's allocation failing first.
    ("expanded q", lambda q, k, v, r: ma.flex_flash_attn_func(q[:1].expand(2**31 - 1, 2, 8), k, v, *r), ValueError,
     "q: must be row-major contiguous"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(rng, case):
    _, call, error, message = case
    mask = ma.masks.causal(32)
    q, k, v, _ = make(rng, mask, 2, 1, 8, "fp32", "cpu")
    with pytest.raises(error) as info:
        call(q, k, v, ranges(mask, "cpu"))
    assert message in str(info.value), str(info.value)


def test_double_backward_is_an_error_not_a_dropped_term(rng):
    """The backward is no graph: a gradient taken with create_graph=True must refuse a second differentiation
    (it silently contributed nothing, so a gradient penalty lost the attention's term)."""
    mask = ma.masks.causal(16)
    q, k, v, _ = make(rng, mask, 2, 1, 8, "fp64", "cpu")
    q.requires_grad_()
    for second in (lambda g: torch.autograd.grad(g.pow(2).sum() + q.sum(), q),  # gave 1s: the attention's term lost
                   lambda g: (g.pow(2).sum() + q.sum()).backward()):
        out, _ = ma.flex_flash_attn_func(q, k, v, *ranges(mask, "cpu"))
        g, = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
        with pytest.raises(RuntimeError, match="attention gradients are not differentiable"):
            second(g)
    out, _ = ma.flex_flash_attn_func(q, k, v, *ranges(mask, "cpu"))  # create_graph, first order only: as without
    g, = torch.autograd.grad(out.sum(), q, create_graph=True)
    assert torch.equal(g, torch.autograd.grad(ma.flex_flash_attn_func(q, k, v, *ranges(mask, "cpu"))[0].sum(), q)[0])
    g.mul_(0.5)  # and it is no view: in-place changes (gradient clipping) work


def test_forward_ad_is_an_error_not_a_lost_tangent(rng):
    """Forward-mode AD (dual tensors that need no grad) got a result without a tangent; now torch's error."""
    import torch.autograd.forward_ad as fwad
    mask = ma.masks.causal(16)
    q, k, v, _ = make(rng, mask, 2, 1, 8, "fp64", "cpu")
    with fwad.dual_level(), pytest.raises(NotImplementedError, match="jvp"):
        ma.flex_flash_attn_func(fwad.make_dual(q, torch.ones_like(q)), k, v, *ranges(mask, "cpu"))
    out, _ = ma.flex_flash_attn_func(q, k, v, *ranges(mask, "cpu"))  # and no dual level: runs as before
    assert out.shape == q.shape


def test_neutral_api_names_an_unsupported_torch_device(rng):
    """ma.forward with torch tensors on 'meta' raised RuntimeError('std::bad_cast') from the extension."""
    mask = ma.masks.causal(16)
    q, k, v, _ = make(rng, mask, 2, 1, 8, "fp32", "cpu")
    for args, name in (((q.to("meta"), k.to("meta"), v.to("meta")), "q"), ((q, k.to("meta"), v), "k")):
        with pytest.raises(ValueError, match=f"{name}: tensors on meta are not supported"):
            ma.forward(mask, *args)


# ---- GPU only ----

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")


@cuda
def test_device_mismatch_is_an_error(rng):
    mask = ma.masks.causal(64)
    q, k, v, _ = make(rng, mask, 2, 1, 64, "bf16", "cuda")
    with pytest.raises(ValueError, match="same device"):
        ma.flex_flash_attn_func(q, k.cpu(), v, *ranges(mask, "cuda"))


@cuda
def test_runs_on_the_current_stream(rng):
    mask = ma.masks.varlen_causal([0, 300, 1000])
    q, k, v, _ = make(rng, mask, 4, 4, 128, "bf16", "cuda")
    r = ranges(mask, "cuda")
    want, _ = ma.flex_flash_attn_func(q, k, v, *r)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # the result is only right if the kernels queue behind this on `side`
        got, _ = ma.flex_flash_attn_func(q, k, v, *r)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@cuda
@pytest.mark.parametrize("deterministic", [True, False])
def test_cuda_graph_captures_forward_and_backward(rng, deterministic):
    mask = ma.masks.varlen_block_causal([0, 700, 1500, 2048], 128)
    q, k, v, sink = make(rng, mask, 8, 2, 128, "bf16", "cuda", "sh")
    r = ranges(mask, "cuda")
    leaves = [x.requires_grad_() for x in (q, k, v, sink)]
    do = torch.randn(q.shape, device="cuda", dtype=q.dtype)

    def step():
        for x in leaves:
            x.grad = None
        out, _ = ma.flex_flash_attn_func(q, k, v, *r, sink=sink, deterministic=deterministic)
        out.backward(do)
        return out.detach().clone(), [x.grad.clone() for x in leaves]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = step()  # warm-up on a stream that is not the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_grads = step()
    for x in leaves:  # poison what the replay must recompute
        x.grad.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    if deterministic:
        assert torch.equal(static_out, eager[0])
        for got, want in zip(static_grads, eager[1]):
            assert torch.equal(got, want)
    else:
        torch.testing.assert_close(static_out, eager[0], rtol=0, atol=0)
        for got, want in zip(static_grads, eager[1]):
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


CONCATENATED_HEADS = """
import numpy as np, torch, magi_attn as ma, reference as ref
rng = np.random.default_rng(int(__import__("sys").argv[1]))
mask = ma.masks.varlen_causal([0, 5, 77, 78, 140, 300])
for hq, d, dtype in ((8, 64, torch.bfloat16), (4, 128, torch.float16)):
    t = lambda *s: torch.from_numpy(rng.standard_normal(s)).to(device="cuda", dtype=dtype)
    q, k, v = t(300, hq, d), t(300, 1, d), t(300, 1, d)
    sink = torch.from_numpy(rng.standard_normal((2, hq))).float().cuda()
    leaves = [x.requires_grad_() for x in (q, k, v, sink)]
    r = tuple(torch.from_numpy(a).cuda() for a in (mask.q_ranges, mask.k_ranges, mask.attn_type_map))
    out, lse = ma.flex_flash_attn_func(q, k, v, *r, sink=sink, sink_layout="sh")
    do = torch.from_numpy(rng.standard_normal(out.shape)).to(out)
    out.backward(do)
    host = lambda x: x.detach().double().cpu().numpy()
    keep = ref.keep_matrix(mask.q_ranges, mask.k_ranges, mask.attn_type_map, 300, 300)
    grads = ref.backward(host(q), host(k), host(v), host(do), keep, None, 0.0, host(sink), "sh")
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    for g, leaf, want in zip(("dq", "dk", "dv", "dsink"), leaves, grads):
        ref.assert_close(g, host(leaf.grad), want, name, grad=True)
print("concatenated heads OK")
"""


@cuda
def test_concatenated_heads_env_matches_reference(rng):
    """MAGI_ATTENTION_CATGQA=1 (read once per process: a child process) on GQA / MQA causal documents, sink."""
    import os
    import pathlib
    import subprocess
    import sys

    env = dict(os.environ, MAGI_ATTENTION_CATGQA="1",
               PYTHONPATH=os.pathsep.join([str(pathlib.Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    seed = str(int(rng.integers(1 << 30)))
    done = subprocess.run([sys.executable, "-c", CONCATENATED_HEADS, seed], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "concatenated heads OK" in done.stdout, done.stdout + done.stderr
