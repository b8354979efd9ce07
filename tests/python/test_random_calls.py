"""Random valid calls of flex_flash_attn_func, forward and autograd, against the fp64 reference (SPEC section 5):
the mask families users build (conftest.random_mask), grids from one token, GQA / MQA, every head dim the engine
takes, sinks (sh / ssh, some -inf), softcap, scale, fp32 out, max_logits, deterministic mode. fp64 and fp32 on the
CPU; bf16 and fp16 on a GPU, at every head dim up to the build's largest tile."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # CI installs torch (README): this runs there

import magi_attn as ma  # noqa: E402
import reference as ref  # noqa: E402
from conftest import random_mask  # noqa: E402

TORCH = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CALLS = {"cpu": 60, "cuda": 80}


def devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() and ma.build_info()["cuda_head_dim_tiles"] else [])


def random_call(rng, device):
    """The arguments of one random valid call, and a description that names it when it fails."""
    small = device == "cpu"
    total_q, total_k = (int(rng.integers(1, 90 if small else 400)) for _ in range(2))
    family, mask = random_mask(rng, total_q, total_k)
    hq, hkv = [(1, 1), (2, 1), (3, 3), (4, 2), (6, 3), (8, 1), (8, 8)][rng.integers(0, 7)]
    if small:
        d = 8 * int(rng.integers(1, 17))
    else:  # every multiple of 8 up to the largest tile, the common ones more often
        largest = max(ma.build_info()["cuda_head_dim_tiles"])
        d = int(rng.choice([64, 128, largest])) if rng.random() < 0.4 else 8 * int(rng.integers(1, largest // 8 + 1))
    dtype = str(rng.choice(["fp64", "fp32"] if small else ["bf16", "fp16"]))
    sink_layout = [None, "sh", "ssh"][rng.integers(0, 3)]
    sinks = int(rng.integers(1, 5))
    call = dict(mask=mask, hq=hq, hkv=hkv, d=d, dtype=dtype, sink_layout=sink_layout, sinks=sinks,
                softcap=float(rng.choice([0.0, 0.0, 5.0, 30.0])),
                scale=None if rng.random() < 0.6 else float(rng.uniform(0.02, 0.3)),
                fp32_out=bool(dtype in ("bf16", "fp16") and rng.random() < 0.3),
                max_logits=bool(rng.random() < 0.5), deterministic=bool(rng.random() < 0.3))
    name = (f"{family} {mask.total_q}x{mask.total_k} ({len(mask)} slices) heads {hq}:{hkv} D {d} {dtype} "
            f"sink {sink_layout}x{sinks} softcap {call['softcap']} scale {call['scale']} fp32 out {call['fp32_out']} "
            f"max_logits {call['max_logits']} deterministic {call['deterministic']}; mask {mask.to_json()[:400]}")
    return call, name


def run_and_check(rng, device, call):
    mask, dtype = call["mask"], call["dtype"]
    tensor = lambda *s: torch.from_numpy(rng.standard_normal(s)).to(device=device, dtype=TORCH[dtype])  # noqa: E731
    q, k, v = tensor(mask.total_q, call["hq"], call["d"]), tensor(mask.total_k, call["hkv"], call["d"]), \
        tensor(mask.total_k, call["hkv"], call["d"])
    sink = None
    if call["sink_layout"]:
        shape = (call["sinks"], call["hq"]) if call["sink_layout"] == "sh" else (mask.total_q, call["sinks"], call["hq"])
        sink = torch.from_numpy(rng.standard_normal(shape)).float()
        if sink.numel() and rng.random() < 0.3:
            sink.view(-1)[0] = float("-inf")  # a sink that takes no mass: dsink 0 there
        sink = sink.to(device)
    leaves = [x.requires_grad_() for x in (q, k, v)] + ([sink.requires_grad_()] if sink is not None else [])
    ranges = [torch.from_numpy(a).to(device) for a in (mask.q_ranges, mask.k_ranges, mask.attn_type_map)]
    def attention():
        return ma.flex_flash_attn_func(q, k, v, *ranges, softmax_scale=call["scale"], softcap=call["softcap"],
                                       sink=sink, sink_layout=call["sink_layout"] or "sh",
                                       deterministic=call["deterministic"],
                                       out_type=torch.float32 if call["fp32_out"] else None,
                                       return_max_logits=call["max_logits"])

    result = attention()
    out, lse = result[0], result[1]
    assert out.shape == q.shape and out.device == q.device
    assert out.dtype == (torch.float32 if call["fp32_out"] else q.dtype)
    do = torch.from_numpy(rng.standard_normal(out.shape)).to(out)
    grads = torch.autograd.grad(out, leaves, do) if leaves and out.numel() else [torch.zeros_like(x) for x in leaves]

    host = lambda x: x.detach().double().cpu().numpy()  # noqa: E731
    keep = ref.keep_matrix(mask.q_ranges, mask.k_ranges, mask.attn_type_map, mask.total_q, mask.total_k)
    inputs = (host(q), host(k), host(v))
    sink64 = None if sink is None else host(sink)
    layout = call["sink_layout"] or "sh"
    out_ref, lse_ref, max_ref = ref.forward(*inputs, keep, call["scale"], call["softcap"], sink64, layout)
    ref.assert_close("out", host(out), out_ref, dtype)
    ref.assert_lse(host(lse), lse_ref, dtype)
    if call["max_logits"]:
        got = host(result[2])
        assert (np.isneginf(got) == np.isneginf(max_ref)).all(), "max_logits: -inf where the reference is finite"
        finite = np.isfinite(max_ref)
        np.testing.assert_allclose(got[finite], max_ref[finite], rtol=1e-5, atol=1e-4, err_msg="max_logits")
    sizes = {}
    want = ref.backward(*inputs, host(do), keep, call["scale"], call["softcap"], sink64, layout, given_out=host(out),
                        magnitudes=sizes)
    for name, got, expected in zip(("dq", "dk", "dv", "dsink"), grads, want):
        assert got.dtype == (torch.float32 if name == "dsink" else q.dtype), f"{name}: dtype {got.dtype}"
        if name == "dv":
            ref.assert_close(name, host(got), expected, dtype, grad=True)
        else:
            ref.assert_grad(name, host(got), expected, sizes[name], dtype)
    # Rows no slice keeps: exactly zero out and dq, whatever the sink.
    empty = ~keep.any(axis=1)
    assert (host(out)[empty] == 0).all(), "out: rows without keys must be exactly 0"
    if grads:
        assert (host(grads[0])[empty] == 0).all(), "dq: rows without keys must be exactly 0"
        unread = ~keep.any(axis=0)
        assert (host(grads[1])[unread] == 0).all() and (host(grads[2])[unread] == 0).all(), \
            "dk / dv: keys no row reads must be exactly 0"
    if call["deterministic"]:  # the same call again: bitwise the same results (SPEC section 5)
        again = attention()
        regrads = torch.autograd.grad(again[0], leaves, do) if leaves and out.numel() else grads
        for name, a, b in zip(("out", "lse", "max_logits"), result, again):
            assert torch.equal(a, b), f"deterministic: {name} differs on rerun"
        for name, a, b in zip(("dq", "dk", "dv", "dsink"), grads, regrads):
            assert torch.equal(a, b), f"deterministic: {name} differs on rerun"


@pytest.mark.parametrize("device", devices())
def test_random_calls_match_reference(rng, device):
    for i in range(CALLS[device]):
        call, name = random_call(rng, device)
        try:
            run_and_check(rng, device, call)
        except AssertionError as e:
            raise AssertionError(f"call {i}: {name}\n{e}") from None
