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
