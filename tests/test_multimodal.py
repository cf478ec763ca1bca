import numpy as np
import pytest
import torch

from radixcache import IMAGE_ID_BASE, MAX_ID, image_cache_ids, image_runs, mm_window

PH = 9


def test_no_images_returns_ids_unchanged() -> None:
    ids = [1, 2, 3]
    out = image_cache_ids(ids, PH, [])
    assert out.tolist() == ids and out.dtype == np.int64


def test_runs_are_found_in_order() -> None:
    assert image_runs([PH, PH, 1, PH, 2, PH, PH, PH], PH) == [(0, 2), (3, 4), (5, 8)]
    assert image_runs([1, 2], PH) == []


def test_each_run_keyed_by_its_image() -> None:
    ids = [1, PH, PH, PH, 2, PH, PH, 3]
    out = image_cache_ids(ids, PH, [b"cat", b"dog"])
    assert out[[0, 4, 7]].tolist() == [1, 2, 3], "text ids are unchanged"
    img = out[[1, 2, 3, 5, 6]]
    assert ((img >= IMAGE_ID_BASE) & (img < MAX_ID)).all()
    assert len(set(img.tolist())) == 5, "positions inside a run get distinct ids"
    assert out[2] - out[1] in (1, 1 - IMAGE_ID_BASE), "consecutive positions in a run"
    swapped = image_cache_ids(ids, PH, [b"dog", b"cat"])
    assert swapped[1] != out[1] and swapped[5] != out[5]
    assert swapped[5] == image_cache_ids([PH, PH], PH, [b"cat"])[0], "a run's ids depend only on its image"


def test_same_image_same_ids_and_image_types() -> None:
    arr = np.arange(12, dtype=np.uint8).reshape(3, 4)
    a = image_cache_ids([PH, PH], PH, [arr])
    b = image_cache_ids([PH, PH], PH, [torch.from_numpy(arr.copy())])
    c = image_cache_ids([PH, PH], PH, [arr.tobytes()])
    assert a.tolist() == b.tolist() == c.tolist()
    assert image_cache_ids([PH, PH], PH, [arr + 1]).tolist() != a.tolist()


def test_an_image_of_any_dtype_is_keyed_by_its_raw_bytes() -> None:
    pixels = torch.randn(3, 4, 5).to(torch.bfloat16)  # numpy has no bfloat16: keyed through a byte view
    raw = pixels.view(torch.int16).numpy().tobytes()
    keyed = image_cache_ids([PH, PH], PH, [pixels])
    assert keyed.tolist() == image_cache_ids([PH, PH], PH, [raw]).tolist()
    turned = pixels.transpose(0, 2)  # not contiguous: keyed by its elements in order
    turned_raw = turned.contiguous().view(torch.int16).numpy().tobytes()
    assert image_cache_ids([PH], PH, [turned]).tolist() == image_cache_ids([PH], PH, [turned_raw]).tolist()
    changed = pixels.clone()
    changed[0, 0, 0] += 1
    assert image_cache_ids([PH, PH], PH, [changed]).tolist() != keyed.tolist()
    strided = np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2]  # not contiguous: its elements in order
    assert (
        image_cache_ids([PH], PH, [strided]).tolist() == image_cache_ids([PH], PH, [strided.copy().tobytes()]).tolist()
    )
    every_other = memoryview(b"hello world")[::2]
    assert image_cache_ids([PH], PH, [every_other]).tolist() == image_cache_ids([PH], PH, [b"hlowrd"]).tolist()
    with pytest.raises(TypeError, match="pointers"):
        image_cache_ids([PH], PH, [np.array([object()])])


def test_run_image_count_mismatch_uses_one_combined_digest() -> None:
    ids = [PH, PH, 1, PH]
    two_runs_three_images = image_cache_ids(ids, PH, [b"a", b"b", b"c"])
    ph = two_runs_three_images[[0, 1, 3]]
    assert (ph >= IMAGE_ID_BASE).all() and len(set(ph.tolist())) == 3
    other = image_cache_ids(ids, PH, [b"a", b"b", b"d"])
    assert not set(other[[0, 1, 3]].tolist()) & set(ph.tolist()), "any image change changes every id"
    assert image_cache_ids(ids, PH, [b"ab", b"c", b"x"])[0] != image_cache_ids(ids, PH, [b"a", b"bc", b"x"])[0]


@pytest.mark.parametrize(
    ("ids", "ph", "images", "err", "match"),
    [
        ([1, PH], PH, [], ValueError, "no image bytes"),
        ([1, 2**30], PH, [b"x"], ValueError, "position 1"),
        ([1, -1], PH, [b"x"], ValueError, "position 1"),
        ([1, 2], 2**30, [b"x"], ValueError, "placeholder_id"),
        ([[1, 2]], PH, [b"x"], ValueError, "1-D"),
        ([PH], PH, ["not bytes"], TypeError, "image 0"),
    ],
)
def test_bad_inputs(ids: object, ph: int, images: list[object], err: type[Exception], match: str) -> None:
    with pytest.raises(err, match=match):
        image_cache_ids(ids, ph, images)  # type: ignore[arg-type]


def test_mm_window_scatters_only_its_own_rows() -> None:
    ids = [1, PH, PH, PH, 2, PH, PH, 3]
    full = mm_window(ids, PH, 0, 8)
    assert list(full.rows) == [0, 1, 2, 3, 4] and full.positions.tolist() == [1, 2, 3, 5, 6]
    inside = mm_window(ids, PH, 2, 6)  # a hit ended inside the first image span
    assert list(inside.rows) == [1, 2, 3] and inside.positions.tolist() == [0, 1, 3]
    none = mm_window(ids, PH, 7, 8)
    assert list(none.rows) == [] and none.positions.size == 0
    chunks = [mm_window(ids, PH, s, min(s + 3, 8)) for s in range(0, 8, 3)]
    assert [r for c in chunks for r in c.rows] == list(full.rows), "chunks partition the rows"
    with pytest.raises(ValueError, match="outside"):
        mm_window(ids, PH, 5, 9)
