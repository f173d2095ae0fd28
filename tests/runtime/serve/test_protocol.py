"""Incremental text with stop strings (runtime/serve/protocol.py's TextStream) over the tiny model's
word-level tokenizer."""

from __future__ import annotations

from runtime.serve.protocol import TextStream


def test_text_stream_never_shows_part_of_a_stop_string(tiny):
    stream = TextStream(tiny.tokenizer, ["w9 w10"])
    assert stream.push(20) == ("w20", False)
    assert stream.push(9) == (" ", False)  # "w9" may begin the stop string: held back
    assert stream.push(11) == ("w9 w11", False)
    assert stream.push(9) == (" ", False)
    assert stream.push(10) == ("", True)
    assert stream.text.endswith("w9 w10")
