"""TextStream: token ids in, OpenAI deltas out, with no I/O and no service behind it."""

from tandem.cluster.sampling import SamplingParams
from tandem.engine.demo_model import EOS_ID, make_wordlevel_tokenizer
from tandem.gateway.text_stream import TextStream
from tandem.gateway.validation import GenerationInput

TOKENIZER = make_wordlevel_tokenizer(64)


def _stream(**fields) -> TextStream:
    sampling = SamplingParams(temperature=0.0, min_tokens=fields.pop("min_tokens", 0),
                              logprobs=fields.pop("logprobs", None))
    return TextStream(TOKENIZER, GenerationInput(prompt_token_ids=[10, 11], sampling=sampling, max_tokens=8, **fields))


def test_tokens_become_text_and_the_worker_finish_ends_it():
    text = _stream()
    first = text.advance([5, 6], None)
    assert first.text == " t5 t6" and first.finish_reason is None and first.token_ids == [5, 6]
    assert text.advance([], None) is None  # nothing new: nothing to send
    last = text.advance([7], "length")
    assert last.finish_reason == "length" and text.text == " t5 t6 t7" and text.output_token_ids == [5, 6, 7]


def test_a_worker_stop_leaves_out_the_stop_tokens_text():
    text = _stream()
    text.advance([5], None)
    last = text.advance([EOS_ID], "stop")
    assert last.finish_reason == "stop" and text.text == " t5" and text.output_token_ids == [5, EOS_ID]


def test_a_stop_string_ends_the_text_before_the_worker_does():
    text = _stream(stop=["t6"])
    delta = text.advance([5, 6, 7], None)
    assert delta.finish_reason == "stop" and text.stopped_by_string and text.text == " t5 "


def test_min_tokens_holds_off_a_stop_string_token_by_token():
    text = _stream(stop=["t5"], min_tokens=2)
    text.advance([5, 8, 5], None)  # the first t5 is inside the first two tokens; the second is not
    assert text.finish_reason == "stop" and text.text == " t5 t8 "


def test_logprobs_are_kept_one_entry_per_token():
    text = _stream(logprobs=0)
    text.advance([5, 6], None, [[-0.1], [-0.2]])
    text.advance([7], "length")
    assert text.output_logprobs == [[-0.1], [-0.2], None]
