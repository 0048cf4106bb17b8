"""Incremental detokenization (``specjax.io.detokenize``) and the server's text of a request."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import specjax
from specjax.io.detokenize import IncrementalText
from specjax.serving.protocol import TextTracker
from tests.conftest import requires_smollm2


class _Counting:
    """A tokenizer that counts the ids it decodes."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def smol():
    return specjax.describe_model("smollm2-135m-instruct").tokenizer


@requires_smollm2
def test_incremental_text_is_the_whole_decode_at_a_constant_cost_per_token(smol):
    rng = random.Random(1)
    sample = smol("Héllo wörld, 你好，世界! 🙂🙃 code:\n  def f(x): return x\n" * 3)["input_ids"]
    for trial in range(200):  # random ids (special ones, cut characters) and slices of real text
        ids = ([rng.randrange(smol.vocab_size) for _ in range(rng.randint(1, 40))] if trial % 2
               else sample[rng.randrange(len(sample)):][:rng.randint(1, 60)])
        prompt = [rng.randrange(smol.vocab_size) for _ in range(rng.randint(0, 6))]
        d = IncrementalText(smol, prompt)
        parts = [d.add(t) for t in ids]
        assert "".join(parts) + d.flush() == smol.decode(ids, skip_special_tokens=True), (prompt, ids)
        assert not any(p.endswith("\ufffd") for p in parts)  # an unfinished character waits
    counting = _Counting(smol)
    d = IncrementalText(counting)
    n = 1000
    for t in (sample * 20)[:n]:
        d.add(t)
    assert counting.decoded < 8 * n  # decoding all again per token: n * (n + 1) / 2 = 500,500


def _sentencepiece_style():
    """LLaMA's fast tokenizer's decoder chain: the first word's leading space is stripped when decoding."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁The": 3, "▁capital": 4, "▁of": 5, "▁France": 6, "▁is": 7,
             "▁Paris": 8, ".": 9}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("stops", [(), ("s.x",), (" Par",)])
def test_the_served_completion_keeps_the_space_after_the_prompt(stops):
    """As OpenAI and vLLM serve it: prompt text + completion text = the whole sequence's text. ("s.x": the
    text's "s", then "s.", is held back as a stop's possible start, and served when the request ends.)"""
    tok = _sentencepiece_style()
    prompt = tok("The capital of France is", add_special_tokens=False)["input_ids"]
    tracker = TextTracker(tok, stops, prompt)
    pieces = [tracker.feed([t]) for t in (8, 9, 2)]
    served = "".join(pieces + [tracker.finish()])
    if stops == ("s.x",):
        assert pieces == [" Pari", "", ""]  # "s" and then "s." held back; finish serves them
    if stops == (" Par",):
        assert served == "" and tracker.stopped and tracker.served_tokens == 1
    else:
        assert "The capital of France is" + served == tok.decode(prompt + [8, 9, 2], skip_special_tokens=True)
        assert served == " Paris."
    # without the prompt (the CLI's stream, which shows the result's text): the generated tokens decoded alone
    alone = IncrementalText(tok)
    assert "".join(alone.add(t) for t in (8, 9)) + alone.flush() == tok.decode([8, 9]) == "Paris."


def test_a_prompt_ending_inside_a_character_is_not_used_as_context():
    tok = _ByteTokenizer()
    prompt = list("ab€".encode())[:-1]  # the euro sign's last byte is the first generated token
    d = IncrementalText(tok, prompt)
    got = d.add(list("€".encode())[-1]) + d.add(ord("c")) + d.flush()
    assert got == tok.decode([list("€".encode())[-1], ord("c")])  # what the generated tokens decode to


class _ByteTokenizer:
    """Token i < 256 is byte i, decoded as UTF-8 with U+FFFD for what does not decode (byte-level BPE)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")
