"""Stop strings over every chunking of the text: the output is the text up to the stop string
that ends first (through it with `include`), whatever the pieces, that stop string is the one
reported (`matched`: Anthropic's `stop_sequence`), and nothing past it ever goes out."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdserve.textstream import StopStrings

TEXT = st.text("abc\n", max_size=40)
STOPS = st.lists(st.text("abc\n", min_size=1, max_size=4), max_size=3)


def expected(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The text and the stop string that ends first (of two ending together, the longer), found
    alone."""
    ends = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not ends:
        return text, None
    end, _, stop = min(ends)
    return text[:end if include else end - len(stop)], stop


def run(pieces: list[str], stops: list[str], include: bool) -> tuple[str, str | None]:
    """The text that went out and the stop string that ended it (`matched`, set with `stopped`)."""
    cut, out = StopStrings(stops, include), ""
    for piece in pieces:
        out += cut.push(piece)
        if cut.stopped:
            break
    if not cut.stopped:
        out += cut.release()
    assert cut.stopped == (cut.matched is not None)
    return out, cut.matched


@given(text=TEXT, stops=STOPS, include=st.booleans(), cuts=st.lists(st.integers(0, 40)))
def test_every_chunking_cuts_at_the_first_stop_string(text, stops, include, cuts) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert run(pieces, stops, include) == expected(text, stops, include)


@given(text=TEXT, stops=STOPS, include=st.booleans())
def test_nothing_past_the_cut_goes_out_even_in_part(text, stops, include) -> None:
    """Character by character, what went out is always a prefix of the final answer."""
    final, _ = expected(text, stops, include)
    cut, out = StopStrings(stops, include), ""
    for ch in text:
        out += cut.push(ch)
        assert final.startswith(out)


def test_the_stop_string_that_ends_first_cuts_in_one_piece_as_in_many() -> None:
    for pieces in (["xabcd"], list("xabcd")):
        assert run(pieces, ["abcd", "bc"], include=False) == ("xa", "bc")
        assert run(pieces, ["abcd", "bc"], include=True) == ("xabc", "bc")
        assert run(pieces, ["c", "bc"], include=False) == ("xa", "bc")  # the longer of two ending together
