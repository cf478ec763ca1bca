"""Hypothesis strategies for fuzzing a hybrid prefix-cache integration.

Keys are drawn so that they share prefixes and branch at arbitrary points (the cases caches get
wrong: mid-block branches, identical re-sends, one key a prefix of another), from a small
alphabet so that collisions are common.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from ..core.keys import IMAGE_ID_BASE

__all__ = ["Lifecycle", "image_prompts", "lifecycles", "shared_prefix_keys", "token_keys"]


def token_keys(*, alphabet: int = 4, min_size: int = 1, max_size: int = 24) -> st.SearchStrategy[list[int]]:
    """Token id lists over a small alphabet (ids ``1..alphabet``)."""
    return st.lists(st.integers(1, alphabet), min_size=min_size, max_size=max_size)


@st.composite
def shared_prefix_keys(draw: st.DrawFn, *, roots: int = 3, alphabet: int = 4, max_size: int = 40) -> list[int]:
    """A key made of one of ``roots`` fixed stems, cut at a random point (a branch point, often
    mid-page), plus a random tail; sometimes exactly a stem (identical re-sends)."""
    stems = [[(i * 7 + j * 3) % alphabet + 1 for j in range(max_size)] for i in range(roots)]
    stem = stems[draw(st.integers(0, roots - 1))]
    cut = draw(st.integers(0, max_size // 2 + 8))
    tail = draw(token_keys(alphabet=alphabet, min_size=0, max_size=max_size - cut))
    key = stem[:cut] + tail
    return key or [1]


@st.composite
def image_prompts(draw: st.DrawFn, *, placeholder: int = 9, max_images: int = 3) -> tuple[list[int], list[bytes]]:
    """A prompt with runs of ``placeholder`` (one per image) between text ids, and the images'
    bytes (sometimes equal to each other)."""
    n = draw(st.integers(0, max_images))
    pool = [b"red", b"green", b"blue"]
    images = [pool[draw(st.integers(0, len(pool) - 1))] for _ in range(n)]
    ids: list[int] = draw(token_keys(alphabet=8, max_size=6))
    for _ in images:
        ids += [placeholder] * draw(st.integers(1, 5)) + draw(token_keys(alphabet=8, min_size=1, max_size=6))
    assert all(i < IMAGE_ID_BASE for i in ids)
    return ids, images


@dataclass(frozen=True)
class Lifecycle:
    """One request's life: its prompt, tokens it decodes, and whether it ends by abort (at step
    ``abort_at`` of its extends and decodes) or finish."""

    prompt: list[int]
    decode: list[int]
    abort_at: int | None


@st.composite
def lifecycles(draw: st.DrawFn) -> Lifecycle:
    """A request lifecycle over :func:`shared_prefix_keys`."""
    prompt = draw(shared_prefix_keys())
    decode = draw(token_keys(min_size=0, max_size=4))
    abort_at = draw(st.one_of(st.none(), st.integers(0, 6)))
    return Lifecycle(prompt, decode, abort_at)
