"""The fp64 reference of SPEC sections 2, 3 and 5, written in numpy on dense matrices, independent of the
library: kept cells straight from the slice rules, softmax with softcap and sink, the backward, and the
accuracy rules that judge every engine."""
from __future__ import annotations

import numpy as np

TOLERANCE = {  # SPEC section 5: (out, grads) relative L2; fp64 judged by max abs error / max |ref|
    "fp64": (1e-10, 1e-10), "fp32": (1e-5, 1e-5), "fp16": (2e-3, 5e-3), "bf16": (1e-2, 2e-2)}
LSE_TOLERANCE = {"fp64": 1e-9, "fp32": 1e-5, "fp16": 1e-3, "bf16": 1e-3}


def keep_matrix(q_ranges, k_ranges, types, total_q: int, total_k: int) -> np.ndarray:
    """[total_q, total_k] bool: the cells the slices keep (SPEC section 2, local indices i, j)."""
    keep = np.zeros((total_q, total_k), dtype=bool)
    for (qs, qe), (ks, ke), t in zip(np.asarray(q_ranges).tolist(), np.asarray(k_ranges).tolist(), list(types)):
        sq, sk = qe - qs, ke - ks
        if sq <= 0 or sk <= 0:
            continue
        i = np.arange(sq)[:, None]
        j = np.arange(sk)[None, :]
        cell = np.ones((sq, sk), dtype=bool)
        if t in (1, 3):
            cell &= j <= i + (sk - sq)
        if t in (2, 3):
            cell &= j >= i
        assert not (keep[qs:qe, ks:ke] & cell).any(), "reference: slices overlap"
        keep[qs:qe, ks:ke] |= cell
    return keep


def _logits(qh, kh, scale, softcap):
    x = scale * (qh @ kh.T)
    return (softcap * np.tanh(x / softcap), x) if softcap > 0 else (x, x)


def _sink_logits(sink, layout, h, tq):
    """[Tq, S] sink logits of head h, or None."""
    if sink is None:
        return None
    return np.broadcast_to(sink[:, h][None, :], (tq, sink.shape[0])) if layout == "sh" else sink[:, :, h]


def forward(q, k, v, keep, scale=None, softcap=0.0, sink=None, sink_layout="sh"):
    """fp64 out [Tq, Hq, D], lse [Tq, Hq] (with the sink), max_logits [Hq]."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    sink = None if sink is None else np.asarray(sink, dtype=np.float64)
    tq, hq, d = q.shape
    group = hq // k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    out = np.zeros_like(q)
    lse = np.full((tq, hq), -np.inf)
    max_logits = np.full(hq, -np.inf)
    for h in range(hq):
        s, _ = _logits(q[:, h], k[:, h // group], scale, softcap)
        s = np.where(keep, s, -np.inf)
        if keep.any():
            max_logits[h] = s[keep].max()
        parts = [s] if sink is None else [s, _sink_logits(sink, sink_layout, h, tq)]
        allv = np.concatenate(parts, axis=1)
        m = allv.max(axis=1, keepdims=True, initial=-np.inf)
        m = np.where(np.isfinite(m), m, 0.0)
        total = np.exp(allv - m).sum(axis=1, keepdims=True)
        with np.errstate(divide="ignore"):
            row_lse = np.log(total) + m
        finite = np.isfinite(row_lse)
        p = np.where(keep & finite, np.exp(np.where(keep, s, 0.0) - np.where(finite, row_lse, 0.0)), 0.0)
        out[:, h] = p @ v[:, h // group]
        lse[:, h] = row_lse[:, 0]
    return out, lse, max_logits


def backward(q, k, v, do, keep, scale=None, softcap=0.0, sink=None, sink_layout="sh", given_out=None,
             magnitudes=None):
    """fp64 dq, dk, dv and dsink (None without a sink). Delta = rowsum(do * out) takes the out the backward was
    given (`given_out`: what the engine returned, rounded to its dtype), else the exact forward's. A dict passed as
    `magnitudes` receives dq / dk / dsink's sums of |terms| (the size of a gradient before it cancels)."""
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    sink64 = None if sink is None else np.asarray(sink, dtype=np.float64)
    out, lse, _ = forward(q, k, v, keep, scale, softcap, sink64, sink_layout)
    if given_out is not None:
        out = np.asarray(given_out, dtype=np.float64)
    tq, hq, d = q.shape
    group = hq // k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dsink = None if sink is None else np.zeros_like(sink64)
    size = {"dq": np.zeros_like(q), "dk": np.zeros_like(k), "dsink": None if sink is None else np.zeros_like(sink64)}
    for h in range(hq):
        kh, vh = k[:, h // group], v[:, h // group]
        s, x = _logits(q[:, h], kh, scale, softcap)
        row_lse = lse[:, h:h + 1]
        p = np.where(keep & np.isfinite(row_lse), np.exp(np.where(keep, s, 0.0) - np.where(np.isfinite(row_lse), row_lse, 0.0)), 0.0)
        delta = (do[:, h] * out[:, h]).sum(axis=1, keepdims=True)
        dp = do[:, h] @ vh.T
        ds, ds_size = p * (dp - delta), p * (np.abs(dp) + np.abs(delta))
        if softcap > 0:
            ds, ds_size = (t * (1.0 - np.tanh(x / softcap) ** 2) for t in (ds, ds_size))
        dq[:, h] = scale * ds @ kh
        dk[:, h // group] += scale * ds.T @ q[:, h]
        dv[:, h // group] += p.T @ do[:, h]
        size["dq"][:, h] = abs(scale) * ds_size @ np.abs(kh)
        size["dk"][:, h // group] += abs(scale) * ds_size.T @ np.abs(q[:, h])
        if dsink is not None:
            w = np.where(np.isfinite(row_lse), np.exp(_sink_logits(sink64, sink_layout, h, tq) - np.where(np.isfinite(row_lse), row_lse, 0.0)), 0.0)
            if sink_layout == "sh":
                dsink[:, h] = -(w * delta).sum(axis=0)
                size["dsink"][:, h] = np.abs(w * delta).sum(axis=0)
            else:
                dsink[:, :, h] = -(w * delta)
                size["dsink"][:, :, h] = np.abs(w * delta)
    if magnitudes is not None:
        magnitudes.update(size)
    return dq, dk, dv, dsink


def assert_close(name: str, got, ref, dtype: str, grad: bool = False) -> None:
    """SPEC section 5 for out / gradients: NaN never passes."""
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
    assert np.isfinite(got).all(), f"{name}: non-finite values"
    tol = TOLERANCE[dtype][1 if grad else 0]
    if dtype == "fp64":
        err = np.abs(got - ref).max(initial=0.0) / max(np.abs(ref).max(initial=0.0), 1e-300)
        assert err <= tol, f"{name}: max abs error / max |ref| = {err:.3g} > {tol}"
    else:
        norm = np.linalg.norm(ref)
        err = np.linalg.norm(got - ref) / norm if norm > 0 else np.linalg.norm(got)
        assert err <= tol, f"{name}: relative L2 error {err:.3g} > {tol}"


def assert_lse(got, ref, dtype: str) -> None:
    """-inf exactly where the row keeps nothing; elsewhere finite and within the absolute tolerance."""
    got = np.asarray(got, dtype=np.float64)
    empty = np.isneginf(ref)
    assert (np.isneginf(got) == empty).all(), "lse: -inf where the reference is finite or the other way round"
    assert np.isfinite(got[~empty]).all(), "lse: non-finite values on non-empty rows"
    err = np.abs(got[~empty] - ref[~empty]).max(initial=0.0)
    assert err <= LSE_TOLERANCE[dtype], f"lse: max abs error {err:.3g} > {LSE_TOLERANCE[dtype]}"


CANCELLED = 0.01  # a gradient whose norm is below 1% of its terms' is judged against that 1% (the C++ judge's rule)


def assert_grad(name: str, got, ref, magnitude, dtype: str) -> None:
    """SPEC section 5 for a gradient that may cancel: dq / dk as assert_close, but with ||ref|| floored at 1% of
    ||sum of |terms|||, since rounding the inputs (out above all) moves a cancelled sum by its terms' size; dsink,
    a sum of one sign-changing term per row, always against its terms (fp32's bound for fp64 inputs)."""
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
    assert np.isfinite(got).all(), f"{name}: non-finite values"
    size = np.linalg.norm(magnitude)
    if name == "dsink":
        tol = TOLERANCE["fp32" if dtype == "fp64" else dtype][1]
        err = np.linalg.norm(got - ref) / size if size > 0 else np.linalg.norm(got - ref)
        assert err <= tol, f"dsink: ||got - ref|| / ||terms|| = {err:.3g} > {tol}"
        return
    if np.linalg.norm(ref) >= CANCELLED * size:
        assert_close(name, got, ref, dtype, grad=True)
        return
    tol = TOLERANCE[dtype][1]
    floor = CANCELLED * size
    err = np.linalg.norm(got - ref) / floor if floor > 0 else np.linalg.norm(got - ref)
    assert err <= tol, f"{name} (cancelled: ||ref|| {np.linalg.norm(ref):.3g}): ||got - ref|| / (1% of ||terms||) = {err:.3g} > {tol}"
