"""Request bodies: what is accepted, and the 400 naming the field for everything else."""

from __future__ import annotations

import pytest

from kivi.serving.errors import ApiError
from kivi.serving.params import parse_chat, parse_completion

MSG = [{"role": "user", "content": "hi"}]


def test_chat_fields_are_read():
    r = parse_chat({"model": "whatever", "messages": MSG, "max_tokens": 7, "temperature": 0.7, "top_p": 0.5,
                    "stop": "x", "stream": True, "n": 1, "user": "u", "stream_options": {"include_usage": True}})
    assert (r.model, r.max_tokens, r.temperature, r.top_p, r.stop, r.stream) == ("whatever", 7, 0.7, 0.5, ("x",), True)
    assert not r.greedy and r.messages == ({"role": "user", "content": "hi"},)
    assert parse_chat({"messages": MSG, "max_completion_tokens": 3, "max_tokens": 9}).max_tokens == 3
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert parse_chat({"messages": [{"role": "user", "content": parts}]}).messages[0]["content"] == "ab"
    assert parse_chat({"messages": MSG, "temperature": 0, "seed": None}).greedy  # null = not given


@pytest.mark.parametrize("t", [1e-300, 5e-324, 9.99e-6])
def test_a_tiny_temperature_is_greedy_as_in_the_engine(t):
    """The request and the engine's Sampling read a temperature by one rule (kivi.sampling)."""
    from kivi.serving.engine import Sampling

    assert parse_chat({"messages": MSG, "temperature": t}).greedy and Sampling(4, t).greedy
    assert not parse_chat({"messages": MSG, "temperature": 1e-5}).greedy and not Sampling(4, 1e-5).greedy


def test_completion_prompt_forms():
    assert parse_completion({"prompt": "abc"}).prompt == "abc"
    assert parse_completion({"prompt": ["abc"]}).prompt == "abc"
    assert parse_completion({"prompt": [3, 4, 5]}).prompt == (3, 4, 5)
    assert parse_completion({"prompt": "a", "echo": False, "suffix": ""}).max_tokens is None


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": MSG, "seed": 3}, "seed"),
    ({"messages": MSG, "tools": []}, "tools"),
    ({"messages": MSG, "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": MSG, "logprobs": True}, "logprobs"),
    ({"messages": MSG, "n": 2}, "n"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSG, "max_tokens": True}, "max_tokens"),
    ({"messages": MSG, "max_tokens": 2.5}, "max_tokens"),
    ({"messages": MSG, "temperature": -1}, "temperature"),
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "top_p": 0}, "top_p"),
    ({"messages": MSG, "top_p": 1.5}, "top_p"),
    ({"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": MSG, "stop": [""]}, "stop"),
    ({"messages": MSG, "stop": 3}, "stop"),
    ({"messages": MSG, "stream": "yes"}, "stream"),
    ({"messages": MSG, "stream_options": {"chunk_size": 2}}, "stream_options"),
    ({"messages": MSG, "model": 7}, "model"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_chat_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_chat(body)
    assert e.value.status == 400 and e.value.param == param and param.split(".")[0].split("[")[0] in e.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"), ({}, "prompt"), ({"prompt": "a", "echo": True}, "echo"),
    ({"prompt": "a", "suffix": "z"}, "suffix"), ({"prompt": "a", "best_of": 2}, "best_of"),
    ({"prompt": "a", "messages": MSG}, "messages"),
])
def test_completion_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("body", [[1, 2], "text", 3, None])
def test_a_body_that_is_not_an_object(body):
    with pytest.raises(ApiError, match="JSON object") as e:
        parse_chat(body)
    assert e.value.code == "invalid_body"


def test_ignore_eos_is_read_on_both_endpoints_and_must_be_a_bool():
    """vLLM's ``ignore_eos`` extension field: read as given (default false); anything but a JSON bool is a 400."""
    assert parse_completion({"prompt": "a", "ignore_eos": True}).ignore_eos is True
    assert parse_chat({"messages": MSG, "ignore_eos": False}).ignore_eos is False
    assert parse_completion({"prompt": "a"}).ignore_eos is False
    for bad in (1, "true", [True]):
        with pytest.raises(ApiError) as e:
            parse_completion({"prompt": "a", "ignore_eos": bad})
        assert e.value.status == 400 and e.value.param == "ignore_eos" and repr(bad) in e.value.message
        assert "true or false" in e.value.message
