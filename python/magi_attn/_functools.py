"""Helpers with the reference system's names: masks from cumulative lengths or windows, padding, batch dims."""
from __future__ import annotations

import numpy as np

from ._mask import Mask, _cu, _size, masks


def _window(window_size, causal: bool) -> tuple:
    try:
        left, right = (_size(w, "window_size") for w in window_size)
    except (TypeError, ValueError):
        raise TypeError(f"window_size: expected (left, right) ints, got {window_size!r}") from None
    if causal and right > 0:
        raise ValueError(f"window_size: a causal mask has no right window (got right = {right}; allowed: <= 0)")
    return left, 0 if causal else right


def _as_framework_of(like, mask: Mask):
    """q_ranges, k_ranges (int32 [n, 2]) and attn_type_map (int32 [n]) in the framework and device of `like`."""
    arrays = (mask.q_ranges, mask.k_ranges, mask.attn_type_map)
    if type(like).__module__.startswith("torch"):
        import torch
        return tuple(torch.from_numpy(a).to(like.device) for a in arrays)
    return arrays


def infer_attn_mask_from_cu_seqlens(cu_seqlens_q, cu_seqlens_k, causal: bool = False, window_size=(-1, -1)):
    """Packed documents: document d pairs q [cu_q[d], cu_q[d+1]) with k [cu_k[d], cu_k[d+1]), full, causal
    (bottom-right aligned) or a sliding window inside it (window_size (left, right), -1 = unbounded; q and k
    documents must then have equal lengths). Returns (q_ranges, k_ranges, attn_type_map, total_seqlen_q,
    total_seqlen_k), the arrays int32 in the framework of cu_seqlens_q (torch: on its device, else numpy)."""
    left, right = _window(window_size, causal)
    cu_q, cu_k = _cu(cu_seqlens_q, "cu_seqlens_q"), _cu(cu_seqlens_k, "cu_seqlens_k")
    if left < 0 and right < 0 and not causal:
        mask = masks.varlen_full(cu_q, cu_k)
    elif left < 0 and causal:
        mask = masks.varlen_causal(cu_q, cu_k)
    else:
        if cu_q != cu_k:
            raise ValueError("window_size: a sliding window needs cu_seqlens_q == cu_seqlens_k (self-attention)")
        mask = masks.varlen_sliding_window(cu_q, left, right)
    return (*_as_framework_of(cu_seqlens_q, mask), mask.total_q, mask.total_k)


def infer_attn_mask_from_sliding_window(q_range, k_range, window_size):
    """The slices of a sliding window over one block: q_range [qs, qe) and k_range [ks, ke) of equal length,
    query i keeping keys i - left .. i + right of the block (-1 = unbounded). Returns (q_ranges, k_ranges,
    attn_type_map) as numpy int32 arrays: at most three slices (causal, full / bi_causal, inv_causal pieces)."""
    try:
        (qs, qe), (ks, ke) = ((_size(x, name) for x in r) for r, name in ((q_range, "q_range"), (k_range, "k_range")))
    except (TypeError, ValueError):
        raise TypeError(f"q_range, k_range: expected two (start, end) int pairs, got {q_range!r}, {k_range!r}") from None
    if qe - qs != ke - ks or qe < qs:
        raise ValueError(f"q_range, k_range: need two ranges of equal length, got [{qs}, {qe}) and [{ks}, {ke})")
    left, right = _window(window_size, False)
    local = masks.sliding_window(qe - qs, left, right)
    # Shifted in int64 and checked as a mask (ranges within [0, 2^31)), then handed back as int32.
    block = Mask(local.q_ranges.astype(np.int64) + qs, local.k_ranges.astype(np.int64) + ks, local.attn_type_map)
    return block.q_ranges, block.k_ranges, block.attn_type_map


def compute_pad_size(total_seqlen_q: int, cp_size: int, chunk_size: int) -> int:
    """Tokens to append so that the sequence splits into whole chunks, an equal number per rank."""
    total, cp, chunk = _size(total_seqlen_q, "total_seqlen_q"), _size(cp_size, "cp_size"), _size(chunk_size, "chunk_size")
    if cp < 1 or chunk < 1 or total < 0:
        raise ValueError("compute_pad_size: need total_seqlen_q >= 0, cp_size >= 1 and chunk_size >= 1")
    block = cp * chunk
    return (block - total % block) % block


def squash_batch_dim(x):
    """[batch, seq, ...] -> [batch * seq, ...] (the packed layout every call here takes)."""
    if not hasattr(x, "shape") or not hasattr(x, "reshape"):
        raise TypeError(f"x: expected an array or tensor, got {type(x).__name__}")
    if len(x.shape) < 2:
        raise ValueError(f"x: expected at least 2 dims [batch, seq, ...], got shape {list(x.shape)}")
    # Not -1: with no elements its size is ambiguous (torch and numpy refuse it).
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
