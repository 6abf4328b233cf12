"""Stop strings: cut before the match, never leak part of a stop string."""

from __future__ import annotations

from tandem.gateway.stop import StopChecker


def run(stops, pieces):
    checker = StopChecker(stops)
    sent = []
    for piece in pieces:
        sent.append(checker.feed(piece))
        if checker.stopped:
            break
    else:
        sent.append(checker.flush())
    return "".join(sent), checker.stopped, sent


def test_no_stop_strings_passes_everything_through():
    checker = StopChecker([])
    assert checker.feed("abc") == "abc"
    assert checker.feed("def") == "def"
    assert checker.flush() == ""
    assert not checker.stopped


def test_stop_inside_one_piece():
    text, stopped, _ = run(["END"], ["hello END world"])
    assert (text, stopped) == ("hello ", True)


def test_stop_straddles_pieces_and_is_never_sent():
    text, stopped, sent = run(["\n\nUser:"], ["Sure.", "\n", "\nUs", "er:", " more"])
    assert (text, stopped) == ("Sure.", True)
    assert all("\n" not in piece for piece in sent)


def test_hold_back_releases_on_flush_when_nothing_matches():
    checker = StopChecker(["xyz"])
    assert checker.feed("abcx") == "ab"  # the last len("xyz") - 1 chars may start a match: held
    assert checker.feed("y") == "c"
    assert checker.feed("q") == "x"
    assert checker.flush() == "yq"
    assert not checker.stopped


def test_earliest_of_several_stops_wins():
    text, stopped, _ = run(["world", "lo w"], ["hel", "lo world"])
    assert (text, stopped) == ("hel", True)


def test_stop_at_the_very_start():
    text, stopped, _ = run(["ab"], ["a", "b", "c"])
    assert (text, stopped) == ("", True)


def test_text_property_is_cut_and_feed_after_stop_is_ignored():
    checker = StopChecker(["."])
    checker.feed("one. two")
    assert checker.stopped and checker.text == "one"
    assert checker.feed("more") == "" and checker.flush() == ""


def test_empty_stop_strings_are_ignored():
    text, stopped, _ = run(["", "zz"], ["abc"])
    assert (text, stopped) == ("abc", False)


def test_include_stop_str_in_output_ends_the_text_after_the_match():
    checker = StopChecker(["END", "EN"], include_stop=True)
    sent = [checker.feed("hello E"), checker.feed("ND world")]
    assert checker.stopped and "".join(sent) == "hello END" == checker.text  # earliest; at a tie, first listed


def test_at_one_position_the_first_listed_stop_string_wins():
    assert run(["ab", "abc"], ["xxabcx"])[0] == "xx"
    checker = StopChecker(["abc", "ab"], include_stop=True)
    assert checker.feed("xxabcx") == "xxabc"


def test_text_fed_before_min_tokens_cannot_stop_but_a_stop_string_ending_later_can():
    checker = StopChecker(["STOP"])
    assert checker.feed("a STOP b ST", match=False) == "a STOP b"  # held back: what could start a stop string
    assert not checker.stopped
    assert checker.feed("OP c") == " " and checker.stopped and checker.text == "a STOP b "


def test_a_shorter_stop_string_inside_the_unmatched_text_is_not_found_later():
    checker = StopChecker(["ab", "xxxxxx"])
    assert checker.feed("zzab", match=False) == "" and not checker.stopped  # held: could start "xxxxxx"
    assert checker.feed("q") == "" and not checker.stopped  # "ab" ended in unmatched text
    assert checker.flush() == "zzabq"
