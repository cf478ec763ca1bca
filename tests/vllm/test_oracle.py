"""The vLLM oracle's verdicts on hand-made answers (no engine: this runs in the main suite too): a
request that parts from the ground truth where the truth's top two choices were within TIE_NATS
of each other parted at a near tie; anywhere else it is wrong; and at most one request in
TIE_SHARE may part at a near tie."""

from __future__ import annotations

from .harness import TIE_NATS, TIE_SHARE, Served, compare, tie_bound

_CLOSE = TIE_NATS / 2
_FAR = TIE_NATS * 4


def _truth() -> Served:
    """Three requests of three tokens; the second position of request 0 is a near tie."""
    return Served(
        prompts=[[7, 8], [7, 9], [7, 10]],
        answers=[[1, 1, 1], [1, 1, 1], [1, 1, 1]],
        cached=[0, 0, 0],
        margins=[[_FAR, _CLOSE, _FAR], [_FAR, _FAR, _FAR], [_FAR, _FAR, TIE_NATS]],
    )


def _got(answers: list[list[int]], prompts: list[list[int]] | None = None) -> Served:
    return Served(prompts=prompts or _truth().prompts, answers=answers, cached=[0] * len(answers))


def test_the_same_answers_are_neither_wrong_nor_ties() -> None:
    assert compare(_truth(), _got(_truth().answers)) == ([], [])


def test_parting_where_the_truths_top_two_were_close_is_a_tie() -> None:
    assert compare(_truth(), _got([[1, 2, 9], [1, 1, 1], [1, 1, 1]])) == ([], [0])


def test_parting_where_the_truth_chose_decisively_is_wrong() -> None:
    """At the first differing token: request 1 parts at a decisive first token, request 2 at its
    last, whose margin is exactly TIE_NATS (not a near tie); request 0's near tie comes after a
    decisive difference."""
    assert compare(_truth(), _got([[3, 2, 1], [4, 1, 1], [1, 1, 5]])) == ([0, 1, 2], [])


def test_a_request_whose_prompt_differs_is_left_out() -> None:
    prompts = [[7, 8], [7, 9, 0], [7, 10]]
    assert compare(_truth(), _got([[1, 1, 1], [5, 5, 5], [1, 1, 1]], prompts)) == ([], [])


def test_the_tie_bound_is_one_request_in_tie_share() -> None:
    assert TIE_SHARE == 4
    assert tie_bound(_got([[1]] * 48)) == 12 and tie_bound(_got([[1]] * 64)) == 16 and tie_bound(Served()) == 0
