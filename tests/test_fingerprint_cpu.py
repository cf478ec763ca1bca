"""The CPU fingerprint paths of small slots (numpy, and native where linear_state's C extension is
built) equal the torch path, the reference, bit for bit.

Slots hold random bytes (any bit pattern: NaNs and infinities included) in every layout a
supported family produces, in small layouts whose rows are narrower than a word or end in a short
block, and in the pools the product builds (a ``LinearStatePool``'s own tensors, SGLang-like
tensors with a reserved slot 0). ``auto`` picks the native path (numpy where it is not built) for
small contiguous CPU slots only.
"""

from __future__ import annotations

import pytest
import torch

from linear_state import LinearStatePool, StateLayout
from linear_state import fingerprint as fingerprint_mod
from linear_state.fingerprint import NATIVE_MAX_SLOT_BYTES, NUMPY_MAX_SLOT_BYTES, SlotHasher
from linear_state.native import NATIVE

from .random_slots import random_pool

FAST = ("numpy", "native") if NATIVE else ("numpy",)
SMALL = "native" if NATIVE else "numpy"  # what auto takes for a small CPU slot


def _same(tensors: list[torch.Tensor], slots: range) -> None:
    ref = SlotHasher(tensors, kernel="torch")
    assert ref.kernel == "torch"
    for kernel in FAST:
        fast = SlotHasher(tensors, kernel=kernel)
        assert fast.kernel == kernel
        for s in slots:
            assert fast.fingerprint(s) == ref.fingerprint(s), f"slot {s}, {kernel}"


def test_the_cpu_paths_equal_the_torch_path_on_every_family_layout() -> None:
    pytest.importorskip("transformers")
    from linear_state.hf import FAMILIES
    from radixcache.hf.table import real_config

    assert len(FAMILIES) >= 13
    for i, fam in enumerate(FAMILIES):
        layout = StateLayout.from_hf_config(real_config(fam))
        _same(random_pool(layout, 2, i), range(2))


@pytest.mark.parametrize(
    ("conv", "rec", "conv_dtype"),
    [
        ((3, 3), (2, 2, 2), torch.bfloat16),  # rows narrower than a word: int16 words, widened
        ((5,), (3,), torch.bfloat16),  # 10-byte and 12-byte rows: int16 and int32 words
        ((24, 3), (2, 8, 4), torch.bfloat16),  # the SGLang harness's Mamba2 state
        ((7, 70), (9, 65), torch.float32),  # a full block and a short one per row
        ((1,), (1,), torch.float16),  # one element
        ((3,), (5, 2), torch.float8_e4m3fn),  # 3-byte rows: byte words, widened without a sign
    ],
)
def test_short_blocks_and_narrow_rows_give_the_same_value(
    conv: tuple[int, ...], rec: tuple[int, ...], conv_dtype: torch.dtype
) -> None:
    layout = StateLayout(3, conv, rec, conv_dtype=conv_dtype)
    _same(random_pool(layout, 5, 7), range(5))


@pytest.mark.parametrize("kernel", FAST)
def test_a_changed_element_changes_the_fingerprint_in_any_slot_row(kernel: str) -> None:
    tensors = random_pool(StateLayout(2, (24, 3), (2, 8, 4)), 4, 3)
    h = SlotHasher(tensors, kernel=kernel)
    before = [h.fingerprint(s) for s in range(4)]
    tensors[1][1, 2, 1, 7, 3] += 1.0  # layer 1 of slot 2's recurrent state, its last element
    after = [h.fingerprint(s) for s in range(4)]
    assert after[2] != before[2] and [after[i] for i in (0, 1, 3)] == [before[i] for i in (0, 1, 3)]
    with pytest.raises(IndexError):
        h.fingerprint(4)


def test_auto_takes_a_cpu_path_for_small_cpu_slots_and_torch_otherwise() -> None:
    small = random_pool(StateLayout(2, (24, 3), (2, 8, 4)), 3, 1)
    assert SlotHasher(small).kernel == SMALL
    pool = LinearStatePool(StateLayout(2, (24, 3), (2, 8, 4)), 3)
    for t in (pool.conv, pool.recurrent):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    assert SlotHasher([pool.conv, pool.recurrent]).kernel == SMALL
    ref = SlotHasher([pool.conv, pool.recurrent], kernel="torch")
    assert [pool.fingerprint(s) for s in range(3)] == [ref.fingerprint(s) for s in range(3)]
    limit = NATIVE_MAX_SLOT_BYTES if NATIVE else NUMPY_MAX_SLOT_BYTES
    words = limit // 4 // 2 + 1  # float32 rows of two layers: one element over the limit
    assert SlotHasher([torch.zeros(2, 2, words)]).kernel == "torch"
    assert SlotHasher([torch.zeros(2, 2, words - 1)]).kernel == SMALL
    strided = [t.transpose(2, 3) for t in random_pool(StateLayout(2, (4, 3), (2, 8, 4)), 3, 2)]
    assert SlotHasher(strided).kernel == "torch"  # not contiguous: the torch path
    _same([t.contiguous() for t in strided], range(3))
    for kernel in FAST:
        with pytest.raises(ValueError, match="contiguous CPU tensors"):
            SlotHasher(strided, kernel=kernel)
    with pytest.raises(ValueError, match="'numpy'"):
        SlotHasher(small, kernel="jax")


def test_a_view_of_a_larger_tensor_with_a_reserved_first_slot_hashes_as_torch_does() -> None:
    """SGLang's pools: a slot axis with a reserved slot 0, the state a view of a bigger buffer."""
    base = random_pool(StateLayout(4, (24, 3), (2, 8, 4)), 12, 5)
    views = [t[:, 1:] for t in base]  # not contiguous as a whole: torch path under auto
    assert SlotHasher(views).kernel == "torch"
    _same(base, range(12))


def test_native_is_refused_where_the_extension_is_not_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not built (or RADIXCACHE_NATIVE=0): ``"native"`` is refused by name, auto takes numpy."""
    monkeypatch.setattr(fingerprint_mod, "_NATIVE", None)
    small = random_pool(StateLayout(2, (24, 3), (2, 8, 4)), 3, 1)
    with pytest.raises(ValueError, match="kernel='native' needs linear_state's C extension"):
        SlotHasher(small, kernel="native")
    assert SlotHasher(small).kernel == "numpy"
    _same_numpy = SlotHasher(small, kernel="numpy")
    assert _same_numpy.fingerprint(1) == SlotHasher(small, kernel="torch").fingerprint(1)


@pytest.mark.skipif(not NATIVE, reason="linear_state's C extension is not built here")
def test_the_native_call_refuses_what_it_cannot_read() -> None:
    import numpy as np

    from linear_state.native import MODULE

    assert MODULE is not None
    views = [np.zeros((2, 3, 5), dtype=np.int64)]
    weights = np.ones((2, 1), dtype=np.int64)
    assert MODULE.fingerprint(views, 1, weights, 64) == 0
    with pytest.raises(TypeError, match="views must be a list"):
        MODULE.fingerprint(tuple(views), 1, weights, 64)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weights must be"):
        MODULE.fingerprint(views, 1, np.ones(2, dtype=np.int64), 64)
    with pytest.raises(ValueError, match="do not fit weights"):
        MODULE.fingerprint(views, 1, np.ones((1, 1), dtype=np.int64), 64)  # one row of weights for two
    with pytest.raises(ValueError, match=r"\[L, S, words\]"):
        MODULE.fingerprint([np.zeros((2, 3, 5), dtype=np.float64)], 1, weights, 64)
    with pytest.raises(ValueError, match="block must be positive"):
        MODULE.fingerprint(views, 1, weights, 0)
    with pytest.raises(IndexError, match=r"slot -1 outside \[0, 3\)"):
        MODULE.fingerprint(views, -1, weights, 64)
