"""Stop strings across delta boundaries, and the hold-back that keeps them out of streams."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.stop_strings import StopMatch, find_stop_string, num_held_back_chars


def test_match_spanning_the_delta_boundary() -> None:
    text = "hello </an" + "swer> more"
    match = find_stop_string(text, len("swer> more"), ["</answer>"])
    assert match == StopMatch(text="hello ", stop="</answer>", index=6)


def test_earliest_occurrence_wins_over_list_order() -> None:
    match = find_stop_string("xxabcd", 4, ["cd", "ab"])
    assert match is not None and match.stop == "ab" and match.text == "xx"


def test_same_position_first_listed_wins() -> None:
    match = find_stop_string("say STOP now", 12, ["STOP", "ST"])
    assert match is not None and match.stop == "STOP" and match.text == "say "


def test_occurrence_inside_old_text_is_not_reported_again() -> None:
    assert find_stop_string("an END was here, then more", 10, ["END"]) is None


def test_occurrence_ending_exactly_at_old_end_is_old() -> None:
    assert find_stop_string("abcSTOP" + "x", 1, ["STOP"]) is None
    assert find_stop_string("abcSTO" + "P", 1, ["STOP"]) == StopMatch("abc", "STOP", 3)


def test_no_new_text_and_no_stops() -> None:
    assert find_stop_string("STOP", 0, ["STOP"]) is None
    assert find_stop_string("STOP", 4, []) is None
    assert num_held_back_chars("anything", []) == 0


def test_held_back_is_the_longest_tail_that_starts_a_stop() -> None:
    assert num_held_back_chars("hello </an", ["</answer>"]) == 4
    assert num_held_back_chars("hello <", ["</answer>", "<<END>>"]) == 1
    assert num_held_back_chars("x <<EN", ["</answer>", "<<END>>"]) == 4
    assert num_held_back_chars("hello", ["</answer>"]) == 0
    # A complete stop string is find_stop_string's business, not a prefix to hold.
    assert num_held_back_chars("abc", ["abc"]) == 0
    assert num_held_back_chars("ab", ["abc"]) == 2
    assert num_held_back_chars("aa", ["aab"]) == 2
    assert num_held_back_chars("a", ["xa", "ab"]) == 1


def stream(deltas: list[str], stops: list[str]) -> tuple[str, int]:
    """Run the streaming loop: returns (final text, characters streamed before the end)."""
    text, num_streamed = "", 0
    for delta in deltas:
        text += delta
        match = find_stop_string(text, len(delta), stops)
        if match is not None:
            return match.text, num_streamed
        safe = len(text) - num_held_back_chars(text, stops)
        num_streamed = max(num_streamed, safe)
    return text, num_streamed


@st.composite
def stream_cases(draw: st.DrawFn) -> tuple[list[str], list[str]]:
    alphabet = "abc"
    deltas = draw(st.lists(st.text(alphabet, max_size=5), max_size=12))
    candidates = draw(st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=4))
    # No stop inside another: then the first stop to complete is also the earliest to start.
    stops = [s for s in candidates if not any(s != t and s in t for t in candidates)]
    return deltas, list(dict.fromkeys(stops))


@settings(max_examples=300, deadline=None)
@given(stream_cases())
def test_streaming_never_emits_a_stop_and_cuts_at_the_first(
    case: tuple[list[str], list[str]],
) -> None:
    deltas, stops = case
    full = "".join(deltas)
    found = [i for i in (full.find(s) for s in stops) if i != -1]
    expected = full[: min(found)] if found else full
    final, num_streamed = stream(deltas, stops)
    assert final == expected
    # Nothing streamed ever has to be taken back.
    assert num_streamed <= len(final)


def _held_back_by_every_k(text: str, stops: list[str]) -> int:
    """The definition, tried for every tail length (the former, quadratic implementation)."""
    return max(
        (k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])),
        default=0,
    )


@settings(max_examples=500, deadline=None)
@given(
    text=st.text(alphabet="ab<", max_size=30),
    stops=st.lists(st.text(alphabet="ab<", min_size=1, max_size=8), max_size=4),
)
def test_held_back_equals_the_definition(text: str, stops: list[str]) -> None:
    assert num_held_back_chars(text, stops) == _held_back_by_every_k(text, stops)
