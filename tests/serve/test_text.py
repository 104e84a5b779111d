"""Incremental detokenization: stop strings split across tokens are held back and cut."""

from serve.text import TextTracker


class CharTokenizer:
    """Token i is chr(i); enough to test the tracker without a real vocabulary."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _feed(tracker, text, last_reason="length"):
    out = []
    for i, ch in enumerate(text):
        delta, reason = tracker.add(ord(ch), last_reason if i == len(text) - 1 else None)
        out.append(delta)
        if reason:
            return "".join(out), reason
    return "".join(out), None


def test_text_without_stops_streams_every_token():
    tracker = TextTracker(CharTokenizer())
    assert tracker.add(ord("a"), None) == ("a", None)
    assert _feed(tracker, "bc") == ("bc", "length") and tracker.text == "abc"


def test_stop_string_across_tokens_is_held_back_then_cut():
    tracker = TextTracker(CharTokenizer(), ["END"])
    assert tracker.add(ord("x"), None) == ("x", None)
    assert tracker.add(ord("E"), None) == ("", None)  # could be the start of "END"
    assert tracker.add(ord("N"), None) == ("", None)
    assert tracker.add(ord("D"), None) == ("", "stop")
    assert tracker.text == "x" and tracker.num_tokens == 4


def test_held_back_text_is_released_when_it_is_not_a_stop():
    tracker = TextTracker(CharTokenizer(), ["END"])
    assert _feed(tracker, "aEx", last_reason=None) == ("aEx", None)
    assert _feed(tracker, "EN", last_reason="length") == ("EN", "length")
