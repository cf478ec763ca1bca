"""Hypothesis strategies for fuzzing a hybrid prefix-cache integration.

Keys are drawn so that they share prefixes and branch at arbitrary points (the cases caches get
wrong: mid-block branches, identical re-sends, one key a prefix of another), from a small
alphabet so that collisions are common.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from ..core.keys import IMAGE_ID_BASE

__all__ = [
    "FUZZ_IMAGES",
    "FuzzRequest",
    "Lifecycle",
    "image_prompts",
    "lifecycles",
    "requests",
    "shared_prefix_keys",
    "token_keys",
]

FUZZ_IMAGES: tuple[bytes, ...] = (b"\x01" * 5000, b"\x01" * 4096 + b"\x02" * 904, b"\x03" * 600)
"""Images of fuzzed prompts: the first two agree on their first 4 KiB and differ after it."""
NAMESPACES: tuple[str | None, ...] = (None, None, "lora-a", "lora-b")
"""Namespaces of fuzzed requests: several tenants and adapters sharing the same ids."""


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
def image_prompts(
    draw: st.DrawFn,
    *,
    placeholder: int = 9,
    max_images: int = 3,
    images_from: tuple[bytes, ...] = (b"red", b"green", b"blue"),
    lead: list[int] | None = None,
) -> tuple[list[int], list[bytes]]:
    """A prompt with runs of ``placeholder`` (one per image) between text ids, and the images'
    bytes (sometimes equal to each other), after ``lead`` text when given."""
    n = draw(st.integers(0, max_images))
    images = [images_from[draw(st.integers(0, len(images_from) - 1))] for _ in range(n)]
    ids: list[int] = list(lead) if lead is not None else draw(token_keys(alphabet=8, max_size=6))
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


@dataclass(frozen=True)
class FuzzRequest:
    """A request the host machine admits: its ids (image placeholders included), its namespace
    (``None``: the base model) and the bytes of its images, in placeholder-run order."""

    ids: list[int]
    namespace: str | None
    images: tuple[bytes, ...]

    def __repr__(self) -> str:
        """As the constructor call, each of :data:`FUZZ_IMAGES` by its name: a printed failing
        program stays readable (the images are kilobytes) and still runs as Python."""
        images = ", ".join(
            f"FUZZ_IMAGES[{FUZZ_IMAGES.index(im)}]" if im in FUZZ_IMAGES else repr(im) for im in self.images
        )
        if len(self.images) == 1:
            images += ","
        return f"FuzzRequest(ids={self.ids!r}, namespace={self.namespace!r}, images=({images}))"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """What hypothesis's pretty printer (and IPython's) shows: the same one line as repr."""
        printer.text(repr(self))


@st.composite
def requests(draw: st.DrawFn, *, placeholder: int = 9) -> FuzzRequest:
    """Mostly :func:`shared_prefix_keys` prompts, some with images (images that differ anywhere,
    the same image at another position, runs a hit may cut), in one of a few namespaces that share
    the same ids."""
    namespace = draw(st.sampled_from(NAMESPACES))
    if draw(st.booleans()):
        return FuzzRequest(draw(shared_prefix_keys()), namespace, ())
    # One shape, so that prompts with different images (or the same image elsewhere) share the
    # text around them and a hit can reach into an image span.
    run = 4
    ids = [1, 2, *([placeholder] * run)]
    images = [draw(st.sampled_from(FUZZ_IMAGES))]
    if draw(st.booleans()):  # a second image after a separator: the same one elsewhere, or another
        ids += [5, *([placeholder] * run)]
        images.append(draw(st.sampled_from(FUZZ_IMAGES)))
    ids += draw(token_keys(alphabet=4, min_size=1, max_size=6))
    return FuzzRequest(ids, namespace, tuple(images))
