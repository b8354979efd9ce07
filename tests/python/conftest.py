"""Shared fixtures: fresh random inputs every run (the seed is printed), poisoned outputs, mask generators."""
from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

import magi_attn
from magi_attn import _arrays


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")  # shown when the test fails
    return np.random.default_rng(seed)


def _poison(array):
    """NaN into a new float output, so that an element the engine never writes fails the comparison."""
    module = type(array).__module__.split(".")[0]
    if module == "torch":
        if array.is_floating_point():
            array.fill_(float("nan"))
    elif module in ("numpy", "cupy"):
        if array.dtype.kind == "f":
            array.fill(float("nan"))
    elif array.__dlpack_device__()[0] == 1:  # a library array on the host
        ctypes.memset(array.address, 0xFF, array.nbytes)  # all-ones bytes: NaN in every float format
    return array


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    original = _arrays.Framework.empty
    monkeypatch.setattr(_arrays.Framework, "empty", lambda self, *a: _poison(original(self, *a)))
    try:
        from magi_attn import torch_ops
    except ImportError:
        return
    new = torch_ops._new
    monkeypatch.setattr(torch_ops, "_new", lambda *a, **kw: _poison(new(*a, **kw)))


def random_rectangles(rng, total_q: int, total_k: int, slices: int) -> magi_attn.Mask:
    """Up to `slices` disjoint rectangles (q bands x k segments, so rows are shared: q-overlap), each of a random
    type, some left empty; rows no rectangle covers stay empty."""
    bands = max(1, int(round(np.sqrt(slices))))
    per_band = max(1, -(-slices // bands))
    q_cuts = np.unique(np.concatenate([[0, total_q], rng.integers(0, total_q + 1, bands - 1)]))
    q_ranges, k_ranges, types = [], [], []
    for qs, qe in zip(q_cuts[:-1], q_cuts[1:]):
        k_cuts = np.unique(np.concatenate([[0, total_k], rng.integers(0, total_k + 1, per_band - 1)]))
        for ks, ke in zip(k_cuts[:-1], k_cuts[1:]):
            if len(q_ranges) < slices and rng.random() < 0.85:
                q_ranges.append((int(qs), int(qe)))
                k_ranges.append((int(ks), int(ke)))
                types.append(int(rng.integers(0, 4)))
    return magi_attn.Mask(q_ranges, k_ranges, types, total_q, total_k)


def random_documents(rng, total: int) -> list:
    """cu_seqlens of documents of 1 to ~total / 2 tokens that cover [0, total)."""
    cu = [0]
    while cu[-1] < total:
        cu.append(cu[-1] + int(rng.integers(1, max(2, total // 2) + 1)))
    cu[-1] = total
    return cu


def random_mask(rng, total_q: int, total_k: int) -> tuple:
    """(family, Mask): one of the mask families users build (the C++ tests' random_mask draws the same ones)."""
    m = magi_attn.masks
    family = ["rectangles", "documents", "window", "block_causal", "shared_question", "one_slice"][rng.integers(0, 6)]
    if family == "rectangles":
        return family, random_rectangles(rng, total_q, total_k, int(rng.integers(1, 40)))
    if family == "documents":
        kind = rng.integers(0, 3)
        if kind == 2:  # q and k documents of their own lengths, paired in order
            cu_q, cu_k = random_documents(rng, total_q), random_documents(rng, total_k)
            n = min(len(cu_q), len(cu_k))
            return family, m.varlen_full(cu_q[:n], cu_k[:n]) if rng.random() < 0.5 else m.varlen_causal(cu_q[:n], cu_k[:n])
        cu = random_documents(rng, total_q)
        return family, m.varlen_causal(cu) if kind else m.varlen_full(cu)
    if family == "window":
        left, right = int(rng.integers(-1, total_q + 1)), int(rng.integers(-1, 64))
        if rng.random() < 0.3:
            return family, m.varlen_sliding_window(random_documents(rng, total_q), left, right)
        if rng.random() < 0.3:
            return family, m.global_sliding_window(total_q, int(rng.integers(0, total_q + 1)), int(rng.integers(1, total_q + 1)))
        return family, m.sliding_window(total_q, left, right)
    if family == "block_causal":
        block = int(rng.integers(1, 300))
        return family, m.block_causal(total_q, block) if rng.random() < 0.5 else m.varlen_block_causal(
            random_documents(rng, total_q), block)
    if family == "shared_question":
        return family, m.shared_question(int(rng.integers(0, total_q // 2 + 1)),
                                         [int(rng.integers(0, total_q // 8 + 1)) for _ in range(rng.integers(0, 6))])
    qs, ks = int(rng.integers(0, total_q)), int(rng.integers(0, total_k))  # causal / bi-causal with Sq > Sk: empty rows
    return family, magi_attn.Mask([[qs, int(rng.integers(qs, total_q + 1))]], [[ks, int(rng.integers(ks, total_k + 1))]],
                                  [int(rng.integers(0, 4))], total_q, total_k)
