"""Incremental detokenization: the text of a growing token sequence at a constant cost per token.

Decoding the whole sequence again for every new token (what the server and the CLI's stream did) costs
time that grows with the square of the output: 3.5 s of a 2048-token request on 2 AMD EPYC cores, on
the server's event loop. Here only a window is decoded, as vLLM does: the tokens since the last
complete character (``_read``) and the few before them (``_prefix``), whose text the new tokens extend.
The window's text before the new tokens is cut off the front, so a tokenizer that decodes a token
differently at the start of a text (SentencePiece drops the leading space of the first word) still
gives the text the whole sequence decodes to. Given a prompt, its last tokens open the window, so the
first generated word keeps the space that separates it from the prompt (OpenAI's and vLLM's
completions: ``" Paris."`` after ``"The capital of France is"``).

A token that ends inside a UTF-8 character decodes to U+FFFD (byte-level BPE) or one U+FFFD per byte
(byte-fallback tokenizers): its text waits for the token that completes the character, or for
``flush`` at the end, which gives what decoding the whole sequence gives. (Byte tokens that never form
valid UTF-8, which a byte-fallback tokenizer can be made to emit, may decode to other replacement
characters than one whole decode gives: ``[<0x44>, <0xEA>]`` streams "D\ufffd" where ``decode`` gives two.)"""

from __future__ import annotations

CONTEXT_TOKENS = 4  # prompt tokens before the first generated one: a word's leading space depends on them


class IncrementalText:
    """One request's text as its tokens arrive (``specjax.generate``'s ``on_tokens``): ``add`` each token,
    ``flush`` once at the end; ``text`` is then what ``tokenizer.decode(ids, skip_special_tokens=True)``
    gives for all of them (for valid UTF-8: see the module's note on byte tokens). ``prompt_ids``: a
    completion's prompt, whose last tokens give the first word its leading space (then ``text`` is the
    completion's text after the prompt's)."""

    def __init__(self, tokenizer, prompt_ids=()):
        self.tokenizer = tokenizer
        tail = [int(t) for t in list(prompt_ids)[-CONTEXT_TOKENS:]]
        if tail and self._decode(tail).endswith("\ufffd"):
            tail = []  # the prompt ends inside a character: its text would not be a prefix of the longer one
        self._ids = tail
        self._prefix = 0  # the window: tokens [_prefix, len) are decoded; [_prefix, _read) were read before
        self._read = len(tail)
        self.text = ""  # the generated text so far: complete characters only (until ``flush``)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Append one generated token; returns the new text (empty while a character is unfinished)."""
        self._ids.append(int(token))
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back at the end (an unfinished character as the tokenizer decodes it)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        new = after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += new
        return new
