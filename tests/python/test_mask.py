"""magi_attn.Mask and magi_attn.masks: construction from lists and arrays of every framework, the builders'
kept cells against the slice rules, JSON, description, pictures, and errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

import magi_attn as ma
import reference as ref
from conftest import random_rectangles


def dense(mask: ma.Mask) -> np.ndarray:
    return ref.keep_matrix(mask.q_ranges, mask.k_ranges, mask.attn_type_map, mask.total_q, mask.total_k)


def test_construction_forms_agree():
    a = ma.Mask(q_ranges=[[0, 512], [512, 1024]], k_ranges=[[0, 512], [0, 1024]], types=["full", "causal"])
    b = ma.Mask(np.array([[0, 512], [512, 1024]], np.int32), np.array([[0, 512], [0, 1024]]), [0, 1])
    c = ma.Mask(((0, 512), (512, 1024)), ((0, 512), (0, 1024)), np.array([0, 1], np.int64), 1024, 1024)
    assert a == b == c
    assert a.types == ["full", "causal"] and a.total_q == 1024 and a.total_k == 1024 and len(a) == 2
    assert a.q_ranges.dtype == np.int32 and a.q_ranges.shape == (2, 2)
    assert a.area == 512 * 512 + int(dense(a)[512:].sum())
    assert ma.Mask([], []).total_q == 0 and len(ma.Mask([], [])) == 0
    assert ma.Mask([[0, 4]], [[0, 4]], "CAUSAL") == ma.masks.causal(4)


def test_construction_from_torch_and_jax_arrays():
    torch = pytest.importorskip("torch")
    qr = torch.tensor([[0, 8], [8, 16]], dtype=torch.int32)
    kr = torch.tensor([[0, 8], [0, 16]], dtype=torch.int32)
    assert ma.Mask(qr, kr, torch.tensor([0, 1], dtype=torch.int32)) == ma.Mask(qr.numpy(), kr.numpy(), [0, 1])
    jnp = pytest.importorskip("jax.numpy")
    assert ma.Mask(jnp.asarray(qr.numpy()), jnp.asarray(kr.numpy()), jnp.asarray([0, 1])) == ma.Mask(qr, kr, [0, 1])


@pytest.mark.parametrize("seed", range(3))
def test_builders_keep_the_cells_their_rules_say(seed):
    rng = np.random.default_rng(seed)
    cu = [0, *sorted(rng.choice(np.arange(1, 300), 4, replace=False).tolist()), 300]
    q = np.arange(300)[:, None]
    k = np.arange(300)[None, :]
    doc = np.searchsorted(cu, np.arange(300), side="right") - 1
    same = doc[:, None] == doc[None, :]
    assert (dense(ma.masks.full(300, 200)) == np.ones((300, 200), bool)).all()
    assert (dense(ma.masks.causal(300, 200)) == (np.arange(200)[None, :] <= q - 100)).all()
    assert (dense(ma.masks.varlen_full(cu)) == same).all()
    assert (dense(ma.masks.varlen_causal(cu)) == (same & (k <= q))).all()
    assert (dense(ma.masks.sliding_window(300, 17, 5)) == ((k >= q - 17) & (k <= q + 5))).all()
    assert (dense(ma.masks.varlen_sliding_window(cu, 9, 0)) == (same & (k >= q - 9) & (k <= q))).all()
    assert (dense(ma.masks.block_causal(300, 64)) == (k < (q // 64 + 1) * 64)).all()
    start = np.asarray(cu)[doc][:, None]
    assert (dense(ma.masks.varlen_block_causal(cu, 32)) == (same & (k < start + ((q - start) // 32 + 1) * 32))).all()
    sq = dense(ma.masks.shared_question(50, [100, 150]))
    assert sq[:50, :50].sum() == 50 * 51 // 2 and sq[60, :50].all() and not sq[200, 60]
    gsw = dense(ma.masks.global_sliding_window(300, 20, 30))
    assert (gsw == ((k <= q) & ((k < 20) | (k >= q - 30)))).all()


def test_json_round_trip_and_reference_keys():
    mask = random_rectangles(np.random.default_rng(), 200, 300, 20)
    assert ma.Mask.from_json(mask.to_json()) == mask
    text = json.dumps({"q_ranges": [[0, 4]], "k_ranges": [[0, 4]], "attn_type_map": ["bi_causal"]})
    assert ma.Mask.from_json(text).types == ["bi_causal"]


def test_describe_and_png(tmp_path):
    mask = ma.masks.varlen_causal([0, 3, 8])
    text = mask.describe()
    assert "mask: 2 slices, total_q 8, total_k 8 (valid)" in text and "area: 21 of 64 cells" in text
    assert "'#' all kept" in text
    path = tmp_path / "mask.png"
    mask.to_png(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="cannot create"):
        mask.to_png(tmp_path / "missing" / "mask.png")
    assert not (tmp_path / "missing").exists()
    for path, error in ((None, TypeError), (b"mask.png", TypeError), (str(tmp_path / "a\0b.png"), ValueError)):
        with pytest.raises(error, match="path"):
            mask.to_png(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mask.png"], "a refused path wrote a file"


BAD = [
    (lambda: ma.Mask([[0, 10], [5, 15]], [[0, 10], [0, 10]]), ValueError, "slices 0 and 1 overlap"),
    (lambda: ma.Mask([[0, 10]], [[0, 10]], "sideways"), ValueError, "types: unknown mask type 'sideways'"),
    (lambda: ma.Mask([[0, 10]], [[0, 10]], [4]), ValueError, "types[0]: unknown mask type 4"),
    (lambda: ma.Mask([[0, 10]], [[0, 10]], [1.5]), TypeError, "types[0]: expected a mask type name or id"),
    (lambda: ma.Mask([[0, 10, 20]], [[0, 10]]), ValueError, "q_ranges: expected shape [n, 2]"),
    (lambda: ma.Mask([[0.5, 10]], [[0, 10]]), TypeError, "q_ranges: expected integers"),
    (lambda: ma.Mask([[0, 10]], [[0, 10], [10, 20]]), ValueError, "one entry per slice"),
    (lambda: ma.Mask([[5, 2]], [[0, 10]]), ValueError, "slice 0"),
    (lambda: ma.Mask([[0, 10]], [[0, 10]], total_q=5), ValueError, "slice 0"),
    (lambda: ma.Mask([[0, 2**40]], [[0, 10]]), ValueError, "does not fit int32"),
    (lambda: ma.Mask([[0, 10]], [[0, 10]], total_q="10"), TypeError, "total_q: expected an int"),
    (lambda: ma.Mask.from_json('{"q_ranges": [[0, 4]]}'), ValueError, "k_ranges"),
    (lambda: ma.Mask.from_json(5), TypeError, "text: expected a JSON string"),
    (lambda: ma.masks.varlen_causal([1, 5]), ValueError, "cu_seqlens"),
    (lambda: ma.masks.block_causal(100, 0), ValueError, "block"),
    (lambda: ma.masks.block_causal(100, -1), ValueError, "block: -1 is out of range (allowed: 1 .. 2^31-1)"),
    (lambda: ma.masks.varlen_block_causal([0, 8], -3), ValueError, "(allowed: 1 .. 2^31-1)"),
    (lambda: ma.masks.full(-1), ValueError, "total_q"),
    (lambda: ma.masks.varlen_full([0, 2**33]), ValueError, "cu_seqlens_q: values must fit int32"),
    (lambda: ma.masks.full(2**63), ValueError, "total_q: 9223372036854775808 does not fit int64"),
    (lambda: ma.Mask([[0, 4]], [[0, 4]], {"full": 0}), TypeError, "types: expected one type per slice in order"),
    (lambda: ma.Mask([[0, 4], [4, 8]], [[0, 4], [4, 8]], np.array([[0, 1]])), ValueError, "types: expected shape [n]"),
    (lambda: ma.masks.varlen_causal(np.array([[0, 4], [4, 8]])), ValueError, "cu_seqlens_q: expected a 1-D sequence"),
    (lambda: ma.masks.shared_question(4, 4), ValueError, "answers: expected a 1-D sequence"),
    (lambda: ma.Mask([[0, 4]], [[0, 4]], total_k=-2**64), ValueError, "total_k"),
    (lambda: ma.Mask([[0, 4]], [[0, 4]], total_q=2**40), ValueError, "total_q: 1099511627776 does not fit int32"),
    (lambda: ma.Mask(np.array([[0, 2**63]], np.uint64), [[0, 4]]), ValueError,
     "q_ranges: 9223372036854775808 does not fit int64"),
    # Empty arrays of the wrong shape were taken for "no slices"; only [] (and [0, 2]) are.
    (lambda: ma.Mask([[]], [[]]), ValueError, "q_ranges: expected shape [n, 2] (one [start, end) pair per slice), got [1, 0]"),
    (lambda: ma.Mask(np.zeros((0, 2), int), np.zeros((0, 3), int)), ValueError, "k_ranges: expected shape [n, 2]"),
    (lambda: ma.Mask([[0, 4]], [[0, 4]], np.array([["full"]])), ValueError, "types: expected shape [n]"),
    (lambda: ma.Mask([[0, 4]], [[0, 4]], np.array(["sideways"])), ValueError, "types[0]: unknown mask type 'sideways'"),
    # Python ints past int64 and None were "expected integers, got dtype object".
    (lambda: ma.Mask([[0, 2**70]], [[0, 4]]), ValueError, "q_ranges: 1180591620717411303424 does not fit int64"),
    (lambda: ma.Mask([[0, 4]], [[-2**64, 4]]), ValueError, "k_ranges: -18446744073709551616 does not fit int64"),
    (lambda: ma.Mask(None, [[0, 4]]), TypeError, "q_ranges: expected an array or a sequence of integers, got None"),
]


@pytest.mark.parametrize("case", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_masks_raise(case):
    call, error, message = case
    with pytest.raises(error) as info:
        call()
    assert message in str(info.value), str(info.value)


# ---- the reference system's helpers ----


def test_types_as_arrays_of_names():
    """A numpy array of type names is what a list of them is (it was 'expected integers, got dtype <U6')."""
    want = ma.Mask([[0, 4], [4, 8]], [[0, 4], [0, 8]], ["full", "causal"])
    for types in (np.array(["full", "causal"]), np.array(["full", 1], dtype=object)):
        assert ma.Mask([[0, 4], [4, 8]], [[0, 4], [0, 8]], types) == want
    assert len(ma.Mask([], [], np.array([], dtype=str))) == 0


def test_infer_attn_mask_from_cu_seqlens():
    cu = [0, 30, 100, 160]
    q_ranges, k_ranges, types, tq, tk = ma.infer_attn_mask_from_cu_seqlens(cu, cu, causal=True)
    assert (tq, tk) == (160, 160) and q_ranges.dtype == np.int32 and types.tolist() == [1, 1, 1]
    assert ma.Mask(q_ranges, k_ranges, types) == ma.masks.varlen_causal(cu)
    q_ranges, k_ranges, types, _, _ = ma.infer_attn_mask_from_cu_seqlens(cu, [0, 40, 90, 200])
    assert ma.Mask(q_ranges, k_ranges, types, 160, 200) == ma.masks.varlen_full(cu, [0, 40, 90, 200])
    q_ranges, k_ranges, types, _, _ = ma.infer_attn_mask_from_cu_seqlens(cu, cu, window_size=(8, 3))
    assert ma.Mask(q_ranges, k_ranges, types) == ma.masks.varlen_sliding_window(cu, 8, 3)
    torch = pytest.importorskip("torch")
    out = ma.infer_attn_mask_from_cu_seqlens(torch.tensor(cu), torch.tensor(cu))
    assert isinstance(out[0], torch.Tensor) and out[0].dtype == torch.int32
    with pytest.raises(ValueError, match="causal mask has no right window"):
        ma.infer_attn_mask_from_cu_seqlens(cu, cu, causal=True, window_size=(4, 2))
    with pytest.raises(ValueError, match="needs cu_seqlens_q == cu_seqlens_k"):
        ma.infer_attn_mask_from_cu_seqlens(cu, [0, 40, 90, 200], window_size=(4, 0))


def test_infer_attn_mask_from_sliding_window_and_padding_helpers():
    q_ranges, k_ranges, types = ma.infer_attn_mask_from_sliding_window([100, 164], [200, 264], (10, 0))
    keep = ref.keep_matrix(q_ranges, k_ranges, types, 164, 264)[100:, 200:]
    i, j = np.arange(64)[:, None], np.arange(64)[None, :]
    assert (keep == ((j <= i) & (j >= i - 10))).all()
    with pytest.raises(ValueError, match="equal length"):
        ma.infer_attn_mask_from_sliding_window([0, 10], [0, 12], (2, 2))
    with pytest.raises(ValueError, match="negative"):  # shifted ranges are checked as a mask's
        ma.infer_attn_mask_from_sliding_window([-4, 0], [-4, 0], (1, 1))
    with pytest.raises(ValueError, match="int32"):
        ma.infer_attn_mask_from_sliding_window([2**31 - 3, 2**31 + 1], [2**31 - 3, 2**31 + 1], (1, 1))
    with pytest.raises(TypeError, match="window_size"):
        ma.infer_attn_mask_from_sliding_window([0, 8], [0, 8], (1.7, 0))
    with pytest.raises(TypeError, match="x: expected an array"):
        ma.squash_batch_dim(None)
    assert ma.compute_pad_size(1000, 4, 64) == 24 and ma.compute_pad_size(1024, 4, 64) == 0
    with pytest.raises(ValueError, match="cp_size >= 1"):
        ma.compute_pad_size(10, 0, 4)
    x = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    assert ma.squash_batch_dim(x).shape == (6, 4) and (ma.squash_batch_dim(x)[3] == x[1, 0]).all()
    # No elements (a row of no features): reshape(-1, 0) is ambiguous to numpy and torch; the size is not.
    assert ma.squash_batch_dim(np.zeros((2, 3, 0))).shape == (6, 0)
    assert ma.squash_batch_dim(np.zeros((0, 3, 0, 5))).shape == (0, 0, 5)
