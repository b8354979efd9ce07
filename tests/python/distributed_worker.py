"""One rank of the distributed tests (tests/python/test_distributed.py launches it with torchrun or mpirun):
the SPEC section 7 distributed cases through magi_attn's torch.distributed API, each checked against one
device computing the whole problem and against the fp64 reference. Prints one 'ok <case>' line per case
on rank 0; any failure raises (non-zero exit)."""
from __future__ import annotations

import os
import sys
import weakref

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import magi_attn as ma  # noqa: E402
import reference as ref  # noqa: E402


def single_device(mask, q, k, v, do, sink, layout):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    s = None if sink is None else sink.detach().clone().requires_grad_()
    out, lse = ma.flex_flash_attn_func(*leaves, *(torch.from_numpy(a) for a in (mask.q_ranges, mask.k_ranges,
                                                                                 mask.attn_type_map)),
                                       sink=s, sink_layout=layout or "sh")
    out.backward(do)
    return out.detach(), lse, [x.grad for x in leaves], None if s is None else s.grad


def run_case(name, mask, heads, d, chunk, device, dtype, layout=None, overlap=1, dispatch="locality"):
    rank, cp = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1234)  # every rank draws the same global inputs
    hq, hkv = heads
    q = torch.randn(mask.total_q, hq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(mask.total_k, hkv, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(mask.total_k, hkv, d, generator=g, dtype=torch.float64).to(dtype)
    do = torch.randn(mask.total_q, hq, d, generator=g, dtype=torch.float64).to(dtype)
    sink = None
    if layout == "sh":
        sink = torch.randn(2, hq, generator=g)
    elif layout == "ssh":
        sink = torch.randn(mask.total_q, 2, hq, generator=g)
    key = ma.magi_attn_flex_key(mask.q_ranges, mask.k_ranges, mask.attn_type_map, mask.total_q, mask.total_k, hq, hkv,
                                d, chunk_size=chunk, overlap_degree=overlap, dispatch=dispatch, sink_layout=layout,
                                device=device)
    assert ma.get_most_recent_key() is key
    to = lambda x: x.to(device)  # noqa: E731
    local = {n: ma.dispatch(to(x), key, "q" if n in ("q", "do") else "k").requires_grad_(n != "do")
             for n, x in (("q", q), ("k", k), ("v", v), ("do", do))}
    local_sink = None
    if sink is not None:
        local_sink = (to(sink) if layout == "sh" else ma.dispatch(to(sink), key)).detach().requires_grad_()
    pos = ma.get_position_ids(key)
    real = pos < mask.total_q
    assert torch.equal(local["q"][real].detach().cpu(), q[pos[real].cpu()]), "dispatch: rows differ from x[position_ids]"
    out, lse = ma.calc_attn(local["q"], local["k"], local["v"], key, sink=local_sink)
    out.backward(local["do"])
    # global results on every rank
    got_out = ma.undispatch(out.detach(), key).cpu()
    got_lse = ma.undispatch(lse, key).cpu()
    got_dq = ma.undispatch(local["q"].grad, key).cpu()
    got_dk = ma.undispatch(local["k"].grad, key, "k").cpu()
    got_dv = ma.undispatch(local["v"].grad, key, "k").cpu()
    want_out, want_lse, (dq, dk, dv), dsink = single_device(mask, to(q), to(k), to(v), to(do), None if sink is None
                                                            else to(sink), layout)
    kind = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    keep = ref.keep_matrix(mask.q_ranges, mask.k_ranges, mask.attn_type_map, mask.total_q, mask.total_k)
    host = lambda x: x.detach().double().cpu().numpy()  # noqa: E731
    sink_np = None if sink is None else sink.double().numpy()
    out_ref, lse_ref, _ = ref.forward(host(q), host(k), host(v), keep, None, 0.0, sink_np, layout or "sh")
    grads_ref = ref.backward(host(q), host(k), host(v), host(do), keep, None, 0.0, sink_np, layout or "sh")
    ref.assert_close("out", host(got_out), out_ref, kind)
    ref.assert_lse(host(got_lse), lse_ref, kind)
    for n, got, want in zip(("dq", "dk", "dv"), (got_dq, got_dk, got_dv), grads_ref[:3]):
        ref.assert_close(n, host(got), want, kind, grad=True)
    if kind != "fp64":  # SPEC: at most 2x the single-device error
        for n, got, single, want in zip(("out", "dq", "dk", "dv"), (got_out, got_dq, got_dk, got_dv),
                                        (want_out, dq, dk, dv), (out_ref, *grads_ref[:3])):
            e_dist = np.abs(host(got) - want).max()
            e_single = np.abs(host(single) - want).max()
            assert e_dist <= 2 * e_single + 1e-6, f"{n}: distributed error {e_dist} > 2 x single-device {e_single}"
    sink_kind = kind if kind in ("bf16", "fp16") else "fp32"  # dsink is fp32, from inputs of `kind`
    if layout == "ssh":
        ref.assert_close("dsink", host(ma.undispatch(local_sink.grad, key)), grads_ref[3], sink_kind, grad=True)
    elif layout == "sh":  # each rank holds its part: the sum over ranks is the whole gradient
        total = local_sink.grad.clone()
        dist.all_reduce(total)
        ref.assert_close("dsink", host(total), grads_ref[3], sink_kind, grad=True)
    # deterministic: a second run gives the same bits
    out2, _ = ma.calc_attn(local["q"], local["k"], local["v"], key, sink=local_sink)
    assert torch.equal(out2, out), "calc_attn is not bitwise reproducible"
    if rank == 0:
        print(f"ok {name} cp={cp} {key.summary().splitlines()[-2 if key.summary().count(chr(10)) > 1 else 0]}",
              flush=True)


def cases(device, dtype):
    rng = np.random.default_rng(7)
    cu = lambda total, n: [0, *sorted(rng.choice(np.arange(1, total), n - 1, replace=False).tolist()), total]  # noqa
    yield "full", ma.masks.full(1400), (2, 1), 32, 128, {}
    yield "varlen full", ma.masks.varlen_full(cu(1200, 7)), (2, 2), 32, 100, {}
    yield "varlen block-causal", ma.masks.varlen_block_causal(cu(1500, 5), 64), (4, 2), 32, 128, {"overlap": 2}
    qo = ma.Mask([[0, 600], [0, 600], [600, 1200], [600, 1200]], [[0, 300], [300, 600], [0, 600], [600, 1200]],
                 ["full", "causal", "full", "bi_causal"])
    yield "q-overlap", qo, (2, 1), 32, 64, {"overlap": 0}
    mixed = ma.Mask([[0, 250], [250, 600], [600, 1000], [250, 600]], [[0, 250], [0, 250], [100, 1000], [250, 600]],
                    ["causal", "full", "inv_causal", "causal"])
    yield "mixed types", mixed, (2, 2), 32, 63, {"dispatch": "greedy"}
    yield "128 small slices forming full", ma.Mask([[i * 8, i * 8 + 8] for i in range(128)] * 1,
                                                   [[0, 1024]] * 128), (1, 1), 32, 253, {}
    yield "uneven q/k 1000x1100", ma.Mask([[0, 1000]], [[0, 1100]], "causal"), (2, 1), 32, 111, {}
    yield "sink sh", ma.masks.varlen_causal(cu(900, 3)), (2, 1), 32, 64, {"layout": "sh"}
    yield "sink ssh", ma.masks.causal(700), (2, 1), 32, 64, {"layout": "ssh", "dispatch": "greedy_swap"}


def varlen_helpers(device):
    """magi_attn_varlen_dispatch (key and dispatched tensor in one call) over packed documents, int token ids
    dispatched like any tensor, and the position ids."""
    cu = [0, 100, 350, 500]
    ids = torch.arange(500, dtype=torch.int64, device=device) * 7
    local_ids, key = ma.magi_attn_varlen_dispatch(ids, cu, cu, 2, 1, 32, causal=True, chunk_size=50, device=device)
    assert ma.get_most_recent_key() is key
    pos = ma.get_position_ids(key)
    real = pos < 500
    assert torch.equal(local_ids[real], ids[pos[real]]) and (local_ids[~real] == 0).all()
    assert torch.equal(ma.undispatch(local_ids, key), ids)
    assert key.mask == ma.masks.varlen_causal(cu)
    # The flex form of the same mask dispatches the same rows; clear_cache(group) forgets the group's most recent key,
    # and a key made before keeps working.
    mask = key.mask
    local_flex, flex_key = ma.magi_attn_flex_dispatch(ids, mask.q_ranges, mask.k_ranges, mask.attn_type_map, 500, 500,
                                                      2, 1, 32, chunk_size=50, device=device)
    assert torch.equal(local_flex, local_ids) and ma.get_most_recent_key() is flex_key
    ma.clear_cache(dist.group.WORLD)
    try:
        ma.get_most_recent_key()
        raise AssertionError("clear_cache(group) kept the group's most recent key")
    except ValueError:
        pass
    assert torch.equal(ma.undispatch(local_flex, flex_key), ids)
    if dist.get_rank() == 0:
        print("ok varlen helpers", flush=True)


def new_mask_after_dispatch(device, dtype):
    """Two layers with different masks on one dispatch: the second key keeps the first's partition, so the tensors
    dispatched once give the second mask's single-device result (forward and gradients)."""
    g = torch.Generator().manual_seed(99)
    first = ma.masks.varlen_causal([0, 300, 420, 800])
    second = ma.masks.varlen_full([0, 128, 700, 800])
    q, k, v, do = (torch.randn(800, 2, 32, generator=g, dtype=torch.float64).to(dtype) for _ in range(4))
    key = ma.magi_attn_flex_key(first.q_ranges, first.k_ranges, first.attn_type_map, 800, 800, 2, 2, 32,
                                chunk_size=40, device=device)
    key2 = ma.make_flex_key_for_new_mask_after_dispatch(second.q_ranges, second.k_ranges, second.attn_type_map, key)
    assert ma.get_most_recent_key() is key2 and key2.mask == second
    assert torch.equal(ma.get_position_ids(key2), ma.get_position_ids(key))
    to = lambda x: x.to(device)  # noqa: E731
    local = {n: ma.dispatch(to(x), key).requires_grad_(n != "do") for n, x in (("q", q), ("k", k), ("v", v), ("do", do))}
    out, lse = ma.calc_attn(local["q"], local["k"], local["v"], key2)
    out.backward(local["do"])
    kind = "fp64" if dtype == torch.float64 else "bf16"
    keep = ref.keep_matrix(second.q_ranges, second.k_ranges, second.attn_type_map, 800, 800)
    host = lambda x: x.detach().double().cpu().numpy()  # noqa: E731
    out_ref, lse_ref, _ = ref.forward(host(q), host(k), host(v), keep, None, 0.0, None, "sh")
    grads_ref = ref.backward(host(q), host(k), host(v), host(do), keep, None, 0.0, None, "sh")
    ref.assert_close("out", host(ma.undispatch(out.detach(), key)), out_ref, kind)
    ref.assert_lse(host(ma.undispatch(lse, key2)), lse_ref, kind)
    for n, got, want in zip(("dq", "dk", "dv"), (local["q"].grad, local["k"].grad, local["v"].grad), grads_ref[:3]):
        ref.assert_close(n, host(ma.undispatch(got, key, "q" if n == "dq" else "k")), want, kind, grad=True)
    try:  # the new mask lives on the dispatched sequences: ranges past them are refused
        ma.make_flex_key_for_new_mask_after_dispatch([[0, 900]], [[0, 900]], [0], key)
    except ValueError as e:
        assert "900" in str(e), str(e)
    else:
        raise AssertionError("no error for ranges past the dispatched sequences")
    if dist.get_rank() == 0:
        print("ok new mask after dispatch", flush=True)


def roll(device):
    """ma.roll on dispatched tensors (host or device) equals torch.roll of the global one (labels for multi-token
    prediction: int token ids, shift -1; 2-byte rows; float rows with a gradient, shift 3); the gradient is rolled
    back."""
    key = ma.magi_attn_varlen_key([0, 90, 333], [0, 90, 333], 2, 1, 32, causal=True, chunk_size=20, device=device)
    ids = (torch.arange(333, dtype=torch.int64) * 3 + 1).to(device)
    local_ids = ma.dispatch(ids, key)
    assert torch.equal(ma.undispatch(ma.roll(local_ids, -1, key), key), torch.roll(ids, -1, 0))
    for x in (torch.tensor([0.5, 1.75, -2.5, 3.0] * 84)[:333, None].to(torch.float8_e4m3fn),  # bits, not values
              (torch.arange(333 * 3) % 3 == 0).view(333, 3), torch.arange(333 * 3, dtype=torch.int8).view(333, 3)):
        back = ma.undispatch(ma.dispatch(x.to(device), key), key)
        assert back.dtype == x.dtype and torch.equal(back.view(torch.uint8).cpu(), x.view(torch.uint8)), x.dtype
    half = torch.arange(333, dtype=torch.bfloat16).to(device)  # 2-byte rows
    assert torch.equal(ma.undispatch(ma.roll(ma.dispatch(half, key), 5, key), key), torch.roll(half, 5, 0))
    x = torch.randn(333, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(device)
    local = ma.dispatch(x, key).requires_grad_()
    rolled = ma.roll(local, 3, key)
    assert torch.equal(ma.undispatch(rolled.detach(), key), torch.roll(x, 3, 0))
    w = torch.randn(333, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).to(device)
    (rolled * ma.dispatch(w, key)).sum().backward()
    grad = ma.undispatch(local.grad, key)
    assert torch.equal(grad, torch.roll(w, -3, 0)), "the gradient of roll by 3 is roll by -3"
    if dist.get_rank() == 0:
        print("ok roll", flush=True)


def bad_inputs(device):
    key = ma.magi_attn_flex_key([[0, 256]], [[0, 256]], [1], 256, 256, 2, 1, 32, chunk_size=32, device=device)
    q = torch.zeros(key.local_q_tokens + 1, 2, 32, device=device)
    kv = torch.zeros(key.local_k_tokens, 1, 32, device=device)
    for call, message in ((lambda: ma.calc_attn(q, kv, kv, key), "local rows"),
                          (lambda: ma.calc_attn(q[:-1].cpu() if device != "cpu" else q[:-1].double(), kv, kv, key),
                           "" if device != "cpu" else "dtype"),
                          (lambda: ma.magi_attn_flex_key([[0, 8]], [[0, 8]], [0], 8, 8, 2, 1, 32, dispatch="fair"),
                           "dispatch: unknown algorithm"),
                          (lambda: ma.dispatch(torch.tensor(1.0, device=device), key), "0-dim"),
                          (lambda: ma.dispatch(kv, "key"), "key: expected a DistAttnKey"),
                          (lambda: ma.magi_attn_flex_key([[0, 8]], [[0, 8]], [0], 8, 8, 2, 1, 32,
                                                         softmax_scale=float("nan")), "softmax_scale"),
                          (lambda: ma.magi_attn_flex_key([[0, 256]], [[0, 256]], [1], 256, 256, 2, 1, 32,
                                                         chunk_size=2**29), "chunk_size")):
        try:
            call()
        except (ValueError, TypeError) as e:
            assert message in str(e), str(e)
        else:
            raise AssertionError(f"no error for: {message}")
    if dist.get_rank() == 0:
        print("ok bad inputs", flush=True)


def groups_end_with_torch(device):
    """The library holds groups weakly: destroy_process_group(group) ends the group at once (gloo joins its
    threads then, not at interpreter exit) and a key on it then says so instead of reaching a dead group."""
    group = dist.new_group(backend="gloo" if device == "cpu" else None)
    key = ma.magi_attn_flex_key([[0, 96]], [[0, 96]], [1], 96, 96, 2, 1, 32, cp_group=group, chunk_size=16,
                                device=device)
    x = torch.randn(96, 3, generator=torch.Generator().manual_seed(5)).to(device)
    assert torch.equal(ma.undispatch(ma.dispatch(x, key), key), x)
    alive = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    assert alive() is None, "a destroyed process group is still alive (something in magi_attn holds it)"
    for call in (lambda: key.group, lambda: ma.undispatch(ma.dispatch(x, key), key)):
        try:
            call()
        except RuntimeError as e:
            assert "cp_group" in str(e) and "destroyed" in str(e), str(e)
        else:
            raise AssertionError("no error for a key whose group was destroyed")
    assert "cp=" in repr(key)
    if dist.get_rank() == 0:
        print("ok groups end with torch", flush=True)


def main():
    rank, size, local = ma.init_distributed(backend=os.environ.get("MAGI_TEST_DIST_BACKEND"))
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    torch.set_num_threads(1)
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    for name, mask, heads, d, chunk, kw in cases(device, dtype):
        run_case(name, mask, heads, d if device == "cpu" else 128, chunk, device, dtype, **kw)
    varlen_helpers(device)
    new_mask_after_dispatch(device, dtype)
    roll(device)
    bad_inputs(device)
    gloo = dist.get_backend() == "gloo"  # (what follows is measured on gloo groups; NCCL's not yet on a device)
    if gloo:
        groups_end_with_torch(device)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # as a training script would; see init_distributed
    world = weakref.ref(dist.group.WORLD)
    dist.barrier()
    dist.destroy_process_group()
    assert not gloo or world() is None, "the default group outlived destroy_process_group (gloo's threads would run into exit)"


if __name__ == "__main__":
    main()
