"""Every sampling parameter through HTTP on the tiny engine (issue 29, item 2): each one honoured changes the output
the way vLLM's does, or is refused by name. The tiny model's greedy answer to PROMPT starts with six "x" (one token
each, byte-level tokenizer): the assertions read that text, and "x" is ASCII, so it only ever comes from that one
token."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.serve.helpers import MODEL, TIMEOUT, Running, error_of, greedy, post, sse_events
from toolchain.runtime.request import SamplingParams
from toolchain.serve.protocol import ACCEPTED_UNUSED, CompletionRequest

PROMPT = "Q: 2+2?\nA:"
EOS = "2"  # the byte-level tokenizer's </s>, as a logit_bias key


def complete(server: Running, max_tokens: int = 6, **fields: Any) -> dict[str, Any]:
    response = post(server.url, {**greedy(max_tokens), "prompt": PROMPT, **fields})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return {**choice, "tokens": response.json()["usage"]["completion_tokens"]}


def token(tokenizer: Any, char: str) -> str:
    (only,) = tokenizer.encode(char, add_special_tokens=False)
    return str(only)


def test_the_plain_greedy_answer_the_others_are_read_against(server: Running) -> None:
    assert complete(server, 12)["text"].startswith("xxxxxx")


def test_logit_bias_minus_100_removes_the_greedy_token_plus_100_forces_one(server: Running, tokenizer: Any) -> None:
    assert "x" not in complete(server, logit_bias={token(tokenizer, "x"): -100})["text"]
    assert complete(server, logit_bias={token(tokenizer, "z"): 100})["text"] == "zzzzzz"
    assert complete(server, logit_bias={})["text"] == "xxxxxx"  # LangChain's default body


def test_presence_penalty_forbids_the_repeat_greedy_makes(server: Running) -> None:
    assert complete(server, presence_penalty=2.0)["text"].count("x") == 1


def test_frequency_and_presence_differ_on_a_token_seen_twice(server: Running) -> None:
    """After one "x" both subtract 0.1 from it and agree; after two, frequency subtracts 0.2, presence still 0.1:
    the tiny model's "x" keeps its lead over the runner-up by between the two."""
    presence = complete(server, presence_penalty=0.1)["text"]
    frequency = complete(server, frequency_penalty=0.1)["text"]
    assert presence.startswith("xxx") and frequency.startswith("xx") and not frequency.startswith("xxx")


def test_repetition_penalty_changes_the_repeating_answer(server: Running) -> None:
    text = complete(server, 12, repetition_penalty=1.3)["text"]
    assert text.startswith("xx") and not text.startswith("xxxxxx")


def test_min_tokens_holds_eos_back_even_when_it_is_biased_to_win(server: Running) -> None:
    eager = complete(server, 12, logit_bias={EOS: 100})
    assert eager["tokens"] == 1 and eager["text"] == "" and eager["finish_reason"] == "stop"
    held = complete(server, 12, logit_bias={EOS: 100}, min_tokens=8)
    assert held["tokens"] == 9 and held["finish_reason"] == "stop"  # 8 tokens, then the eos
    assert held["text"] == complete(server, 8)["text"]


def test_ignore_eos_runs_to_max_tokens_past_eos(server: Running) -> None:
    out = complete(server, 12, logit_bias={EOS: 100}, ignore_eos=True)
    assert out["tokens"] == 12 and out["finish_reason"] == "length"
    assert out["text"] == ""  # eos is a special token: left out of the text, as vLLM
    shown = complete(server, 3, logit_bias={EOS: 100}, ignore_eos=True, skip_special_tokens=False)
    assert shown["text"] == "</s>" * 3


def greedy_ids(server: Running, max_tokens: int) -> list[int]:
    """The greedy answer's token ids, from the server's own engine loop (the HTTP answer carries text only)."""
    ids = post(server.url, {"model": MODEL, "prompt": PROMPT}, path="/tokenize").json()["tokens"]
    return list(server.state.llm.submit(ids, SamplingParams(max_new_tokens=max_tokens)).result().token_ids)


def test_stop_token_ids_end_on_that_token_with_finish_reason_stop(server: Running) -> None:
    ids = greedy_ids(server, 12)
    x = ids[0]
    first_other = next(t for t in ids if t != x)  # the greedy answer starts with six "x": the seventh
    assert ids.index(first_other) == 6
    out = complete(server, 12, stop_token_ids=[first_other])
    assert out["finish_reason"] == "stop" and out["tokens"] == 7 and out["text"] == "xxxxxx"


def test_include_stop_str_in_output_keeps_the_stop_string(server: Running) -> None:
    assert complete(server, 12, stop=["xx"])["text"] == ""
    assert complete(server, 12, stop=["xx"], include_stop_str_in_output=True)["text"] == "xx"
    # min_tokens: the first 4 tokens' text is not searched (vLLM), the stop is found straddling it
    late = complete(server, 12, stop=["xx"], min_tokens=4)
    assert late["text"] == "xxx" and late["finish_reason"] == "stop" and late["tokens"] == 5


@pytest.mark.parametrize(
    "fields",
    [
        {"stop": ["xx"], "min_tokens": 4},
        {"stop": ["xx"], "include_stop_str_in_output": True},
        {"logit_bias": {EOS: 100}, "min_tokens": 5},
        {"stop_token_ids": [int(EOS)], "presence_penalty": 0.1},
    ],
    ids=["min_tokens-stop", "include-stop", "min_tokens-eos", "presence"],
)
def test_streamed_text_equals_the_answer(server: Running, fields: dict[str, Any]) -> None:
    body = {**greedy(12), "prompt": PROMPT, **fields}
    done = complete(server, 12, **fields)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT) as r:
        events = [e["choices"][0] for e in sse_events(r.iter_lines()) if e["choices"]]
    assert "".join(e["text"] for e in events) == done["text"]
    assert events[-1]["finish_reason"] == done["finish_reason"]


def test_min_p_one_keeps_only_the_most_likely_token_and_top_k_minus_one_is_no_limit(server: Running) -> None:
    assert complete(server, 12, temperature=1.5, seed=3, min_p=1.0)["text"] == complete(server, 12)["text"]
    unlimited = complete(server, 12, temperature=1.0, seed=11, top_k=-1)["text"]
    assert unlimited == complete(server, 12, temperature=1.0, seed=11, top_k=0)["text"]


# -- refused by name ---------------------------------------------------------------------------------------------
REFUSED: list[tuple[str, dict[str, Any], str, str]] = [  # what, fields, error.param, in the message
    ("suffix", {"suffix": "def f():"}, "suffix", "suffix"),
    ("empty suffix", {"suffix": ""}, "suffix", "suffix"),
    ("logit_bias text key", {"logit_bias": {"hello": 5}}, "logit_bias", "'hello'"),
    ("logit_bias beyond vocab", {"logit_bias": {"99999": 5}}, "logit_bias", "'99999'"),
    ("logit_bias beyond 100", {"logit_bias": {"5": 100.5}}, "logit_bias", "[-100, 100]"),
    ("min_tokens over max_tokens", {"min_tokens": 7}, "min_tokens", "max_tokens"),
    ("stop_token_ids beyond vocab", {"stop_token_ids": [5, 10**6]}, "stop_token_ids", "1000000"),
    ("17 stop strings", {"stop": [f"s{i}" for i in range(17)]}, "stop", "16"),
    ("presence beyond 2", {"presence_penalty": 2.5}, "presence_penalty", ""),
    ("repetition 0", {"repetition_penalty": 0}, "repetition_penalty", ""),
    ("min_p beyond 1", {"min_p": 1.5}, "min_p", ""),
    ("top_k -2", {"top_k": -2}, "top_k", ""),
]


@pytest.mark.parametrize(("what", "fields", "param", "needle"), REFUSED, ids=[r[0] for r in REFUSED])
def test_what_cannot_be_honoured_is_refused_by_name(
    server: Running, what: str, fields: dict[str, Any], param: str, needle: str
) -> None:
    error = error_of(post(server.url, {**greedy(6), "prompt": PROMPT, **fields}), 400)
    assert error["param"] == param and needle in error["message"], (what, error)


def test_the_common_clients_bodies_pass(server: Running) -> None:
    """lm-eval's generate_until body (seed, up to ~5 stop strings), AIPerf's (ignore_eos + min_tokens = the
    output length it asked for)."""
    lm_eval = {**greedy(8), "prompt": PROMPT, "seed": 1234, "stop": ["\n", "Q:", "</s>", "\n\n", "Question:"]}
    assert post(server.url, lm_eval).status_code == 200
    aiperf = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 9,
        "min_tokens": 9,
        "ignore_eos": True,
        "stream": False,
    }
    response = post(server.url, aiperf, path="/v1/chat/completions")
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 9


# -- a batch mixing every parameter ----------------------------------------------------------------------------
MIXED = [
    {"logit_bias": {EOS: 100}, "min_tokens": 5},
    {"presence_penalty": 2.0},
    {"frequency_penalty": 0.1},
    {"repetition_penalty": 1.3},
    {"logit_bias": {EOS: 100}, "ignore_eos": True},
    {"temperature": 0.9, "min_p": 0.1, "top_k": -1, "seed": 7},
    {"stop": ["xx"], "include_stop_str_in_output": True},
]
PLAIN = ["Q: 2+2?\nA:", "Once upon a time", "The cat sat on the", "hi"]


def test_plain_requests_beside_every_parameter_keep_their_solo_output(server: Running) -> None:
    def plain(prompt: str) -> str:
        return str(post(server.url, {**greedy(10), "prompt": prompt}).json()["choices"][0]["text"])

    solo = [plain(p) for p in PLAIN]
    with ThreadPoolExecutor(len(PLAIN) + len(MIXED)) as pool:
        hosted = [pool.submit(complete, server, 10, **fields) for fields in MIXED]
        together = [pool.submit(plain, p) for p in PLAIN]
        assert [f.result() for f in together] == solo
        assert all(f.result()["tokens"] >= 1 for f in hosted)


def test_every_parameter_named_here_is_honoured_not_merely_accepted() -> None:
    """The fields this module shows acting are out of protocol.ACCEPTED_UNUSED (the inert list) and declared."""
    honoured = {
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "min_p",
        "top_k",
    }
    assert not honoured & set(ACCEPTED_UNUSED)
    assert honoured <= set(CompletionRequest.model_fields) and "suffix" in CompletionRequest.model_fields


def test_ignore_eos_keeps_the_chat_formats_own_end_token() -> None:
    """gpt-oss's <|call|> ends an answer beside EOS (serve/tools.py): ignore_eos drops EOS only."""
    from toolchain.serve.params import sampling_params
    from toolchain.serve.protocol import CompletionRequest

    body = CompletionRequest(model=MODEL, prompt=[5, 6], max_tokens=4, ignore_eos=True)
    params = sampling_params(body, [5, 6], 64, (2,), None, 320, format_stops=(300,))
    assert params.stop_token_ids == (300,)
    plain = sampling_params(body.model_copy(update={"ignore_eos": False}), [5, 6], 64, (2,), None, 320, (300,))
    assert plain.stop_token_ids == (2, 300)
