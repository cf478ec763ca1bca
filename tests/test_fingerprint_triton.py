"""The fused Triton fingerprint (linear_state.fingerprint_triton) equals the torch path bit for bit.

On the CPU the kernel runs through Triton's interpreter, which has to be switched on before the
kernel is first built, so each check runs in a child process with ``TRITON_INTERPRET=1``. Slots
hold random bytes (any bit pattern: NaNs and infinities included), every layout a supported family
produces (transformers' configs and the model cards the docs table uses), the slot a strided row
of a layer-major pool, and small layouts that exercise the short last block, rows narrower than a
word and chunk sizes down to one block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton", reason="the fused fingerprint needs Triton (pip install triton)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PRELUDE = """
import json, torch
from linear_state import StateLayout
from linear_state.fingerprint import SlotHasher

from tests.random_slots import random_pool

def compare(tensors, chunk, slots):
    ref = SlotHasher(tensors, kernel="torch")
    fused = SlotHasher(tensors, kernel="triton", triton_chunk=chunk)
    assert fused.kernel == "triton" and ref.kernel == "torch"
    return [(ref.fingerprint(s), fused.fingerprint(s)) for s in slots]
"""


def _child(body: str) -> object:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    script = _PRELUDE + textwrap.dedent(body)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_fused_kernel_equals_the_torch_path_on_every_family_layout() -> None:
    pytest.importorskip("transformers")
    got = _child(
        """
        from linear_state.hf import FAMILIES
        from radixcache.hf.table import real_config
        out = {}
        for i, fam in enumerate(FAMILIES):
            layout = StateLayout.from_hf_config(real_config(fam))
            pairs = compare(random_pool(layout, 2, i), 2048, [1])
            out[fam] = [[str(a), str(b)] for a, b in pairs]
        print(json.dumps(out))
        """
    )
    assert isinstance(got, dict) and len(got) >= 13, got
    for fam, pairs in got.items():
        for ref, fused in pairs:
            assert ref == fused, (fam, ref, fused)


def test_short_blocks_narrow_rows_and_small_chunks_give_the_same_value() -> None:
    got = _child(
        """
        cases = [
            StateLayout(2, (3, 8), (2, 4, 4)),  # rows shorter than one block
            StateLayout(3, (129, 5), (1, 65, 9), conv_dtype=torch.bfloat16),  # a short last block
            StateLayout(2, (3,), (1,)),  # a 12-byte conv row (int32 words) and a 4-byte one
            StateLayout(1, (5,), (3,), conv_dtype=torch.float16, recurrent_dtype=torch.float16),  # int16 words
            StateLayout(2, (7,), (2, 3), conv_dtype=torch.float8_e4m3fn, recurrent_dtype=torch.float64),  # bytes
        ]
        out = []
        for i, layout in enumerate(cases):
            tensors = random_pool(layout, 4, 100 + i)
            for chunk in (1, 2, 16):
                out.extend([str(a), str(b)] for a, b in compare(tensors, chunk, range(4)))
        # one changed byte changes the fused value too
        tensors = random_pool(cases[1], 2, 7)
        fused = SlotHasher(tensors, kernel="triton", triton_chunk=2)
        before = fused.fingerprint(1)
        tensors[1][2, 1].view(torch.uint8).view(-1)[1000] ^= 1
        out.append([str(before != fused.fingerprint(1)), "True"])
        print(json.dumps(out))
        """
    )
    assert isinstance(got, list) and len(got) == 5 * 3 * 4 + 1
    for ref, fused in got:
        assert ref == fused


def test_the_fused_kernel_refuses_what_it_cannot_read_and_auto_keeps_the_torch_path_on_the_cpu() -> None:
    import torch

    from linear_state.fingerprint import SlotHasher

    conv = torch.zeros(2, 4, 3, 8).transpose(2, 3)  # a transposed window: rows not contiguous
    rec = torch.zeros(2, 4, 2, 4)
    with pytest.raises(ValueError, match="not contiguous"):
        SlotHasher([conv, rec], kernel="triton")
    with pytest.raises(ValueError, match="kernel must be"):
        SlotHasher([rec], kernel="cuda")
    for bad in (0, 3, 2.0, True):
        with pytest.raises(ValueError, match="triton_chunk must be"):
            SlotHasher([rec], triton_chunk=bad)  # type: ignore[arg-type]
    assert SlotHasher([conv, rec]).kernel == "torch"  # auto: Triton is for CUDA tensors


def _aligned(t: torch.Tensor, slot: int) -> bool:
    return (t.data_ptr() + slot * t.stride(1) * t.element_size()) % 16 == 0


def _misaligned(shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """A float32 tensor of ``shape`` starting ``offset`` bytes into a 16-byte-aligned buffer."""
    n = 1
    for d in shape:
        n *= d
    buf = torch.zeros(n * 4 + 64, dtype=torch.uint8)
    start = -buf.data_ptr() % 16 + offset
    return buf[start : start + n * 4].view(torch.float32).view(shape)


@pytest.mark.parametrize(
    ("shapes", "offsets", "want"),
    [
        ([(2, 40, 4)], [0], (0,)),  # 16-byte slots, aligned: one variant
        ([(2, 40, 4)], [4], (0,)),  # 16-byte slots, none aligned: one variant
        ([(2, 40, 6)], [0], (0, 1)),  # 24-byte slots alternate
        ([(2, 40, 3)], [4], (0, 1)),  # 12-byte slots from a misaligned start: slot 1 is the aligned one
        ([(2, 40, 4), (3, 40, 1)], [0, 8], (0, 2)),  # 4-byte slots from 8: slot 2 is aligned
        ([(1, 40, 5), (1, 40, 2)], [0, 0], (0, 1)),  # 20 and 8 bytes: both classes at slot 1
    ],
)
def test_the_warm_up_slots_cover_every_alignment_the_slots_take(
    shapes: list[tuple[int, ...]], offsets: list[int], want: tuple[int, ...]
) -> None:
    from linear_state.fingerprint_triton import alignment_cover

    tensors = [_misaligned(s, o) for s, o in zip(shapes, offsets, strict=True)]
    got = alignment_cover(tensors)
    assert got == want
    covered = {(i, _aligned(t, s)) for s in got for i, t in enumerate(tensors)}
    for s in range(40):  # every slot's variant is among those the warm-up built
        assert all((i, _aligned(t, s)) in covered for i, t in enumerate(tensors)), s
    assert alignment_cover([t[:, :0] for t in tensors]) == ()
    for bad in (0, -16, 16.0, True):
        with pytest.raises(ValueError, match="alignment must be"):
            alignment_cover(tensors, bad)  # type: ignore[arg-type]


def test_the_warm_up_reads_nothing_off_the_fused_path_nor_in_an_empty_pool() -> None:
    import torch

    from linear_state import HostedStatePool, LinearStatePool, StateLayout
    from linear_state.fingerprint import SlotHasher

    rec = torch.zeros(2, 4, 6)
    for kernel in ("torch", "numpy", "auto"):
        assert SlotHasher([rec], kernel=kernel).warm_up() == ()
    layout = StateLayout(2, (3, 8), (2, 4, 4))
    assert LinearStatePool(layout, 4).warm_fingerprint() == ()
    conv, rec = torch.zeros(2, 0, 3, 8, dtype=torch.bfloat16), torch.zeros(2, 0, 2, 4, 4)

    class Lender:
        def take(self, n: int) -> None:
            return None

        def give(self, slots: object) -> None:
            pass

        def available(self) -> int:
            return 0

    assert HostedStatePool(layout, conv, rec, Lender()).warm_fingerprint() == ()


def test_the_fused_warm_up_fingerprints_the_cover_and_changes_no_byte() -> None:
    got = _child(
        """
        from linear_state.fingerprint_triton import alignment_cover
        layout = StateLayout(2, (3,), (1, 3))  # 12-byte conv and recurrent rows: int32 words
        tensors = random_pool(layout, 8, 5)
        before = [t.clone() for t in tensors]
        fused = SlotHasher(tensors, kernel="triton")
        warmed = fused.warm_up()
        raw = lambda t: t.contiguous().view(torch.uint8)  # bytes: random slots hold NaNs
        same = all(torch.equal(raw(a), raw(b)) for a, b in zip(before, tensors))
        print(json.dumps([list(warmed), list(alignment_cover(tensors)), same]))
        """
    )
    assert isinstance(got, list)
    warmed, cover, same = got
    assert warmed == cover and len(cover) >= 2 and same is True


def test_a_fused_kernel_that_cannot_run_falls_back_to_the_torch_path_at_warm_up() -> None:
    # Without a GPU driver (and without the interpreter) Triton cannot launch: what a Triton
    # that does not work with the device looks like to the hasher.
    from linear_state.fingerprint import SlotHasher

    rec = torch.randn(2, 4, 8)
    with pytest.raises(RuntimeError):
        SlotHasher([rec], kernel="triton").warm_up(fallback=False)
    hasher = SlotHasher([rec], kernel="triton")
    with pytest.warns(RuntimeWarning, match="fused Triton fingerprint failed"):
        assert hasher.warm_up() == ()
    assert hasher.kernel == "torch"
    reference = SlotHasher([rec], kernel="torch")
    assert [hasher.fingerprint(s) for s in range(4)] == [reference.fingerprint(s) for s in range(4)]
