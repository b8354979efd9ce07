"""One rank of test_distributed.py's random cases: random valid distributed problems through magi_attn's
torch.distributed API, each judged against the fp64 reference by SPEC section 5 with the judges of
test_random_calls.py. A case draws a mask of the families users build (conftest.random_mask), lengths from one
token, a chunk size from one token, GQA / MQA, fp64 or fp32, a sink (sh / ssh), softcap, scale, an overlap degree
and a dispatch algorithm; some cases call with options other than the key's (a variant planned at call time), roll
the dispatched q, or run a second mask on the same dispatch. Every rank draws the same cases from the seed.
argv: seed cases. Rank 0 prints 'ok random <cases> cases, seed <seed>'; a failure raises naming the case."""
from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import magi_attn as ma  # noqa: E402
import reference as ref  # noqa: E402
from conftest import random_mask  # noqa: E402

TORCH = {"fp64": torch.float64, "fp32": torch.float32}


def host(x):
    return x.detach().double().cpu().numpy()


def check_attention(mask, q, k, v, do, got, grads, scale, softcap, sink, layout, dtype, what):
    """got: global (out, lse, max_logits); grads: global dq, dk, dv and the whole dsink (or None)."""
    keep = ref.keep_matrix(mask.q_ranges, mask.k_ranges, mask.attn_type_map, mask.total_q, mask.total_k)
    sink64 = None if sink is None else host(sink)
    out_ref, lse_ref, max_ref = ref.forward(host(q), host(k), host(v), keep, scale, softcap, sink64, layout)
    ref.assert_close(f"{what}out", host(got[0]), out_ref, dtype)
    ref.assert_lse(host(got[1]), lse_ref, dtype)
    if got[2] is not None:
        mlog = host(got[2])
        assert (np.isneginf(mlog) == np.isneginf(max_ref)).all(), "max_logits: -inf where the reference is finite"
        finite = np.isfinite(max_ref)
        np.testing.assert_allclose(mlog[finite], max_ref[finite], rtol=1e-5, atol=1e-4, err_msg="max_logits")
    sizes = {}
    want = ref.backward(host(q), host(k), host(v), host(do), keep, scale, softcap, sink64, layout,
                        given_out=host(got[0]), magnitudes=sizes)
    for name, g, expected in zip(("dq", "dk", "dv", "dsink"), grads, want):
        if expected is None:
            continue
        if name == "dv":
            ref.assert_close(what + name, host(g), expected, dtype, grad=True)
        else:
            ref.assert_grad(name, host(g), expected, sizes[name], dtype)
    empty, unread = ~keep.any(axis=1), ~keep.any(axis=0)
    assert (host(got[0])[empty] == 0).all() and (host(grads[0])[empty] == 0).all(), "rows without keys: out, dq 0"
    assert (host(grads[1])[unread] == 0).all() and (host(grads[2])[unread] == 0).all(), "unread keys: dk, dv 0"


def run_case(rng):
    total_q = int(rng.integers(1, 400))
    total_k = total_q if rng.random() < 0.6 else int(rng.integers(1, 400))
    family, mask = random_mask(rng, total_q, total_k)
    hq, hkv = [(1, 1), (2, 1), (3, 3), (4, 2), (6, 3)][rng.integers(0, 5)]
    d = 8 * int(rng.integers(1, 9))
    dtype = str(rng.choice(["fp64", "fp32"]))
    layout = [None, "sh", "ssh"][rng.integers(0, 3)]
    chunk = int(rng.choice([1, 7, 16, 33, 64, 128, 512]))
    softcap = float(rng.choice([0.0, 0.0, 5.0]))
    scale = None if rng.random() < 0.6 else float(rng.uniform(0.02, 0.3))
    overlap, dispatch = int(rng.integers(0, 4)), str(rng.choice(["greedy", "greedy_swap", "locality"]))
    variant = rng.random() < 0.3
    name = (f"{family} {mask.total_q}x{mask.total_k} ({len(mask)} slices) heads {hq}:{hkv} D {d} {dtype} sink {layout} "
            f"chunk {chunk} softcap {softcap} scale {scale} overlap {overlap} {dispatch}; mask {mask.to_json()[:300]}")
    tensor = lambda *s: torch.from_numpy(rng.standard_normal(s)).to(TORCH[dtype])  # noqa: E731
    q, k, v, do = tensor(mask.total_q, hq, d), tensor(mask.total_k, hkv, d), tensor(mask.total_k, hkv, d), \
        tensor(mask.total_q, hq, d)
    sink = None
    if layout:
        sink = torch.from_numpy(rng.standard_normal((2, hq) if layout == "sh" else (mask.total_q, 2, hq))).float()
    key = ma.magi_attn_flex_key(mask.q_ranges, mask.k_ranges, mask.attn_type_map, mask.total_q, mask.total_k, hq, hkv,
                                d, chunk_size=chunk, overlap_degree=overlap, dispatch=dispatch, sink_layout=layout,
                                softcap=softcap, softmax_scale=scale, device="cpu")
    if variant:  # options other than the key's: a variant planned at call time
        softcap, scale = float(rng.choice([0.0, 3.0])), float(rng.uniform(0.02, 0.3))
        name += f"; called with softcap {softcap} scale {scale}"
    local = {n: ma.dispatch(x, key, "q" if n in ("q", "do") else "k").requires_grad_(n != "do")
             for n, x in (("q", q), ("k", k), ("v", v), ("do", do))}
    local_sink = None
    if sink is not None:
        local_sink = (sink.clone() if layout == "sh" else ma.dispatch(sink, key)).requires_grad_()
    try:
        options = dict(softcap=softcap, softmax_scale=scale) if variant else {}
        out, lse, max_logits = ma.calc_attn(local["q"], local["k"], local["v"], key, sink=local_sink,
                                            return_max_logits=True, **options)
        out.backward(local["do"])
        dsink = None
        if layout == "sh":  # each rank holds its part
            dsink = local_sink.grad.clone()
            dist.all_reduce(dsink)
        elif layout == "ssh":
            dsink = ma.undispatch(local_sink.grad, key)
        got = (ma.undispatch(out.detach(), key), ma.undispatch(lse, key), max_logits)
        grads = (ma.undispatch(local["q"].grad, key), ma.undispatch(local["k"].grad, key, "k"),
                 ma.undispatch(local["v"].grad, key, "k"), dsink)
        check_attention(mask, q, k, v, do, got, grads, scale, softcap, sink, layout or "sh", dtype, "")
        if rng.random() < 0.3:
            shift = int(rng.integers(-2 * mask.total_q, 2 * mask.total_q + 1))
            rolled = ma.undispatch(ma.roll(local["q"].detach(), shift, key), key)
            assert torch.equal(rolled, torch.roll(q, shift, 0)), f"roll by {shift}"
        _, other = random_mask(rng, mask.total_q, mask.total_k)  # (a family may take lengths of its own)
        if rng.random() < 0.3 and other.total_q <= mask.total_q and other.total_k <= mask.total_k:
            # a second mask over the same sequences, on the same dispatch
            name += f"; second mask {other.to_json()[:300]}"
            key2 = ma.make_flex_key_for_new_mask_after_dispatch(other.q_ranges, other.k_ranges, other.attn_type_map, key)
            leaves = [local[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
            out2, lse2 = ma.calc_attn(*leaves, key2, softcap=softcap, softmax_scale=scale)
            out2.backward(local["do"])
            got2 = (ma.undispatch(out2.detach(), key2), ma.undispatch(lse2, key2), None)
            grads2 = (ma.undispatch(leaves[0].grad, key), ma.undispatch(leaves[1].grad, key, "k"),
                      ma.undispatch(leaves[2].grad, key, "k"), None)
            check_attention(key2.mask, q, k, v, do, got2, grads2, scale, softcap, None, "sh", dtype, "second mask: ")
    except Exception as e:  # the case's description with whatever failed
        raise AssertionError(f"{name}\n{type(e).__name__}: {e}") from None


def main():
    seed, cases = int(sys.argv[1]), int(sys.argv[2])
    ma.init_distributed("gloo")
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    for _ in range(cases):
        run_case(rng)
    if dist.get_rank() == 0:
        print(f"ok random {cases} cases, seed {seed}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
