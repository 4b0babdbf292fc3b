"""Stop strings across delta boundaries, the hold-back that keeps them out of streams, and
their cost per step whatever the text and the stop strings."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.text.stop_strings import StopMatch, StopStringMatcher, StopStrings


def _matcher(stops: list[str]) -> StopStringMatcher:
    return StopStringMatcher(StopStrings(stops))


def _feed_all(matcher: StopStringMatcher, deltas: list[str]) -> StopMatch | None:
    for delta in deltas:
        match = matcher.feed(delta)
        if match is not None:
            return match
    return None


def test_match_spanning_the_delta_boundary() -> None:
    assert _feed_all(_matcher(["</answer>"]), ["hello </an", "swer> more"]) == StopMatch(
        "</answer>", 6)


def test_earliest_occurrence_wins_over_list_order() -> None:
    assert _feed_all(_matcher(["cd", "ab"]), ["xx", "abcd"]) == StopMatch("ab", 2)


def test_same_position_first_listed_wins() -> None:
    assert _matcher(["STOP", "ST"]).feed("say STOP now") == StopMatch("STOP", 4)
    assert _matcher(["ST", "STOP"]).feed("say STOP now") == StopMatch("ST", 4)


def test_a_longer_stop_starting_earlier_wins_over_a_shorter_one_ending_first() -> None:
    # "bc" ends first, "abcd" starts first: the earliest start is the cut.
    assert _matcher(["bc", "abcd"]).feed("xabcd") == StopMatch("abcd", 1)


def test_no_stops_hold_nothing() -> None:
    matcher = _matcher([])
    assert matcher.feed("anything") is None and matcher.num_held_back_chars == 0


def test_held_back_is_the_longest_stop_prefix_at_the_end() -> None:
    for text, stops, held in [
        ("hello </an", ["</answer>"], 4),
        ("hello <", ["</answer>", "<<END>>"], 1),
        ("x <<EN", ["</answer>", "<<END>>"], 4),
        ("hello", ["</answer>"], 0),
        ("ab", ["abc"], 2),
        ("aa", ["aab"], 2),
        ("a", ["xa", "ab"], 1),
    ]:
        matcher = _matcher(stops)
        assert matcher.feed(text) is None
        assert matcher.num_held_back_chars == held, (text, stops)


def stream(deltas: list[str], stops: list[str]) -> tuple[str, int]:
    """Run the streaming loop: returns (final text, characters streamed before the end)."""
    matcher = _matcher(stops)
    text, num_streamed = "", 0
    for delta in deltas:
        text += delta
        match = matcher.feed(delta)
        if match is not None:
            return text[: match.index], num_streamed
        num_streamed = max(num_streamed, len(text) - matcher.num_held_back_chars)
    return text, num_streamed


@st.composite
def stream_cases(draw: st.DrawFn) -> tuple[list[str], list[str]]:
    alphabet = "abc"
    deltas = draw(st.lists(st.text(alphabet, max_size=5), max_size=12))
    stops = draw(st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=4))
    return deltas, list(dict.fromkeys(stops))


@settings(max_examples=500, deadline=None)
@given(stream_cases())
def test_streaming_never_emits_a_stop_and_cuts_at_the_first(
    case: tuple[list[str], list[str]],
) -> None:
    deltas, stops = case
    final, num_streamed = stream(deltas, stops)
    # Nothing streamed ever has to be taken back, and no stop string is left in the text.
    assert num_streamed <= len(final)
    assert not any(stop in final for stop in stops)
    # The cut is where the text, delta by delta, first held a whole stop string.
    text = ""
    for delta in deltas:
        previous, text = text, text + delta
        found = [i for s in stops if (i := text.find(s, max(0, len(previous) - len(s) + 1))) != -1
                 and i + len(s) > len(previous)]
        if found:
            assert final == text[: min(found)]
            return
    assert final == text


def _held_back_by_every_k(text: str, stops: list[str]) -> int:
    """The definition, tried for every tail length."""
    return max(
        (k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])),
        default=0,
    )


@settings(max_examples=500, deadline=None)
@given(
    deltas=st.lists(st.text(alphabet="ab<", max_size=6), max_size=8),
    stops=st.lists(st.text(alphabet="ab<", min_size=1, max_size=8), max_size=4),
)
def test_held_back_equals_the_definition(deltas: list[str], stops: list[str]) -> None:
    matcher = _matcher(stops)
    text = ""
    for delta in deltas:
        text += delta
        if matcher.feed(delta) is not None:
            return
        assert matcher.num_held_back_chars == _held_back_by_every_k(text, stops)


def test_adversarial_text_costs_what_plain_text_does() -> None:
    """Four 1,024-character stop strings of one repeated letter ending in another, and a
    text of that letter: every character extends a near match. Read 4 characters at a
    time, 4,096 characters cost about as much as random text; the former search over the
    text's tail cost about a millisecond a delta here (seconds for these 1,024 deltas)."""
    stops = ["a" * 1023 + end for end in "bcde"]
    adversarial = "a" * 4096
    plain = "the quick brown fox jumps over the lazy dog " * 94

    def cost(text: str) -> float:
        best = float("inf")
        for _ in range(3):
            matcher = _matcher(stops)
            start = time.perf_counter()
            for i in range(0, 4096, 4):
                assert matcher.feed(text[i:i + 4]) is None
            best = min(best, time.perf_counter() - start)
        return best

    # The bound is loose (noise on a shared host); a quadratic search misses it by far.
    assert cost(adversarial) < 4 * cost(plain) + 0.02
