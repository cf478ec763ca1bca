"""The numpy fingerprint path (small CPU slots) equals the torch path, the reference, bit for bit.

Slots hold random bytes (any bit pattern: NaNs and infinities included) in every layout a
supported family produces, in small layouts whose rows are narrower than a word or end in a short
block, and in the pools the product builds (a ``LinearStatePool``'s own tensors, SGLang-like
tensors with a reserved slot 0). ``auto`` picks numpy for small contiguous CPU slots only.
"""

from __future__ import annotations

import pytest
import torch

from linear_state import LinearStatePool, StateLayout
from linear_state.fingerprint import NUMPY_MAX_SLOT_BYTES, SlotHasher

from .random_slots import random_pool


def _same(tensors: list[torch.Tensor], slots: range) -> None:
    ref = SlotHasher(tensors, kernel="torch")
    fast = SlotHasher(tensors, kernel="numpy")
    assert (ref.kernel, fast.kernel) == ("torch", "numpy")
    for s in slots:
        assert fast.fingerprint(s) == ref.fingerprint(s), f"slot {s}"


def test_the_numpy_path_equals_the_torch_path_on_every_family_layout() -> None:
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


def test_a_changed_element_changes_the_numpy_fingerprint_in_any_slot_row() -> None:
    tensors = random_pool(StateLayout(2, (24, 3), (2, 8, 4)), 4, 3)
    h = SlotHasher(tensors, kernel="numpy")
    before = [h.fingerprint(s) for s in range(4)]
    tensors[1][1, 2, 1, 7, 3] += 1.0  # layer 1 of slot 2's recurrent state, its last element
    after = [h.fingerprint(s) for s in range(4)]
    assert after[2] != before[2] and [after[i] for i in (0, 1, 3)] == [before[i] for i in (0, 1, 3)]


def test_auto_takes_numpy_for_small_cpu_slots_and_torch_otherwise() -> None:
    small = random_pool(StateLayout(2, (24, 3), (2, 8, 4)), 3, 1)
    assert SlotHasher(small).kernel == "numpy"
    pool = LinearStatePool(StateLayout(2, (24, 3), (2, 8, 4)), 3)
    for t in (pool.conv, pool.recurrent):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    assert SlotHasher([pool.conv, pool.recurrent]).kernel == "numpy"
    ref = SlotHasher([pool.conv, pool.recurrent], kernel="torch")
    assert [pool.fingerprint(s) for s in range(3)] == [ref.fingerprint(s) for s in range(3)]
    words = NUMPY_MAX_SLOT_BYTES // 4 // 2 + 1  # float32 rows of two layers: one byte over the limit
    big = [torch.zeros(2, 2, words)]
    assert SlotHasher(big).kernel == "torch"
    strided = [t.transpose(2, 3) for t in random_pool(StateLayout(2, (4, 3), (2, 8, 4)), 3, 2)]
    assert SlotHasher(strided).kernel == "torch"  # not contiguous: the torch path
    _same([t.contiguous() for t in strided], range(3))
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        SlotHasher(strided, kernel="numpy")
    with pytest.raises(ValueError, match="'numpy'"):
        SlotHasher(small, kernel="jax")


def test_a_view_of_a_larger_tensor_with_a_reserved_first_slot_hashes_as_torch_does() -> None:
    """SGLang's pools: a slot axis with a reserved slot 0, the state a view of a bigger buffer."""
    base = random_pool(StateLayout(4, (24, 3), (2, 8, 4)), 12, 5)
    views = [t[:, 1:] for t in base]  # not contiguous as a whole: torch path under auto
    assert SlotHasher(views).kernel == "torch"
    _same(base, range(12))
