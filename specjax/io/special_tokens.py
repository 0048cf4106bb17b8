"""Special-token text in prompts: what ``<|im_end|>`` written inside a prompt's text becomes.

- ``"parse"`` (the default, as transformers and vLLM tokenize): it becomes the control token. A user
  who writes their own chat template into a plain prompt needs this.
- ``"text"``: it is ordinary text (tokenized as its characters), so a request's text cannot end its
  own turn or open a system one; the chat template's own control tokens stay control tokens.
- ``"refuse"``: a prompt whose text holds a special token's string is an error naming it.

For chat prompts in ``"text"`` mode the template is rendered with a placeholder for each message so
that the control tokens the *template* wrote can be told from those in the messages. The tokenizer
first splits text at its added tokens and tokenizes each piece between them on its own, so splitting
at the template's control tokens only and tokenizing each piece with special tokens read as text gives
exactly ``"parse"``'s tokens wherever the messages hold no special-token text (tested over SmolLM2's
template), for tokenizers that read a piece alone as they read it within a text (byte-level BPE). That is
checked per request on the conversation without its special text; other tokenizers (SentencePiece's prefix
space on every call, control tokens that strip the whitespace beside them) are refused for "text"."""

from __future__ import annotations

import uuid

from specjax.errors import InputError
from specjax.io.prompts import check_text

POLICIES = ("parse", "text", "refuse")


def check_policy(policy) -> str:
    if policy not in POLICIES:
        raise InputError(f"special_tokens must be one of {list(POLICIES)}, got {policy!r}")
    return policy


def special_strings(tokenizer) -> tuple[str, ...]:
    """The strings of the tokenizer's special added tokens, longest first (the tokenizer's own matching
    takes the longest at each position)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {t.content for t in decoder.values() if getattr(t, "special", False) and t.content}
    found |= {s for s in getattr(tokenizer, "all_special_tokens", ()) if s}
    return tuple(sorted(found, key=lambda s: (-len(s), s)))


def first_special(text: str, specials: tuple[str, ...]) -> tuple[int, str] | None:
    """(index, string) of the leftmost special-token string in ``text`` (longest at that index)."""
    best = None
    for s in specials:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def refuse_special(text: str, tokenizer, label: str) -> None:
    hit = first_special(text, special_strings(tokenizer))
    if hit is not None:
        raise InputError(f"{label} holds the special token {hit[1]!r} as text (at character {hit[0]}), and "
                         f"special_tokens='refuse' refuses it: pass special_tokens='text' to read it as "
                         f"ordinary text, or 'parse' to make it the control token")


def encode_text(tokenizer, text: str, policy: str, label: str) -> list[int]:
    """A prompt without a chat template (the tokenizer's own BOS handling, as ``tokenizer(text)``)."""
    check_text(text, label)  # a lone surrogate: the tokenizer's own error is an unrelated TypeError
    if policy == "refuse":
        refuse_special(text, tokenizer, label)
    if policy == "text":
        return list(tokenizer(text, split_special_tokens=True)["input_ids"])
    return list(tokenizer(text)["input_ids"])


def _apply_template(tokenizer, messages, tokenize: bool):
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize,
                                        return_dict=tokenize)
    return out["input_ids"] if tokenize else out


def encode_chat(tokenizer, messages: list[dict], policy: str, label: str, message_labels=None) -> list[int]:
    """``messages`` (dicts with ``role`` and string ``content``) through the tokenizer's chat template.
    ``label`` names the conversation in errors, ``message_labels`` each message (default: ``label``)."""
    for m, where in zip(messages, message_labels or [label] * len(messages)):
        check_text(m["content"], where)
        if policy == "refuse":
            refuse_special(m["content"], tokenizer, where)
    if policy == "text":
        specials = special_strings(tokenizer)
        if any(first_special(m["content"], specials) for m in messages):
            _check_pieces_tokenize_alike(tokenizer, messages, specials, label)
            return _template_as_text(tokenizer, messages, specials, label)
    return list(_apply_template(tokenizer, messages, tokenize=True))


def _without_specials(text: str, specials) -> str:
    while (hit := first_special(text, specials)) is not None:
        text = text[:hit[0]] + text[hit[0] + len(hit[1]):]
    return text


def _check_pieces_tokenize_alike(tokenizer, messages, specials, label) -> None:
    """Reading the pieces between the template's control tokens one call each must give what one call
    gives. Checked on the same conversation with the special-token text taken out of the messages (where
    the answer is known): it fails for SentencePiece tokenizers that prepend a space to every call's text
    (LLaMA-2's, Mistral's) and control tokens that strip the whitespace beside them, which are refused."""
    cleaned = [{**m, "content": _without_specials(m["content"], specials)} for m in messages]
    if _template_as_text(tokenizer, cleaned, specials, label) != list(_apply_template(tokenizer, cleaned, True)):
        raise InputError(f"{label}: special_tokens='text' is not available with this tokenizer: it reads the chat "
                         f"template's text between control tokens differently piece by piece than in one text "
                         f"(a space prepended to each piece, or control tokens that strip the whitespace beside "
                         f"them); use special_tokens='refuse' or 'parse'")


def _template_as_text(tokenizer, messages, specials, label) -> list[int]:
    marks = [f"\x00specjax-{uuid.uuid4().hex}-{i}\x00" for i in range(len(messages))]
    marked = _apply_template(tokenizer, [{**m, "content": k} for m, k in zip(messages, marks)], tokenize=False)
    real = _apply_template(tokenizer, messages, tokenize=False)
    pieces = _split_at_marks(marked, marks, messages, real, label)
    # The control tokens the template wrote: special strings in the template's own pieces only (one that
    # a message's text completes is the message's, so it stays text).
    segments, text = [], ""
    for piece, is_message in pieces:
        if is_message:
            text += piece
            continue
        while piece:
            hit = first_special(piece, specials)
            if hit is None:
                text += piece
                break
            i, s = hit
            text += piece[:i]
            if text:
                segments.append(("text", text))
            segments.append(("special", s))
            text, piece = "", piece[i + len(s):]
    if text:
        segments.append(("text", text))
    ids = []
    for kind, s in segments:
        if kind == "special":
            ids.append(int(tokenizer.convert_tokens_to_ids(s)))
        else:
            ids.extend(tokenizer(s, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    return ids


def _split_at_marks(marked: str, marks, messages, real: str, label: str) -> list[tuple[str, bool]]:
    """The rendered conversation as (piece, is_message_text) pieces, the messages where the template put them
    (in any order; one it leaves out is not there). Checked against the real rendering: a template that
    changes a message's text beyond trimming it cannot be split, and is refused by name."""
    found = []
    for i, k in enumerate(marks):
        if marked.count(k) > 1:
            raise InputError(f"{label}: special_tokens='text' needs each message's text to appear once in the "
                             f"chat template's output, and this template writes a message "
                             f"{marked.count(k)} times; use special_tokens='refuse' or 'parse'")
        if k in marked:
            found.append((marked.index(k), i))
    pieces, at = [], 0
    for pos, i in sorted(found):
        pieces += [(marked[at:pos], False), (messages[i]["content"], True)]
        at = pos + len(marks[i])
    pieces.append((marked[at:], False))
    if "".join(p for p, _ in pieces) == real:
        return pieces
    trimmed = [(p.strip(), True) if is_msg else (p, False) for p, is_msg in pieces]
    if "".join(p for p, _ in trimmed) == real:  # templates that trim messages (LLaMA-3's)
        return trimmed
    raise InputError(f"{label}: special_tokens='text' cannot tell the chat template's control tokens from the "
                     f"messages' text, because this template changes the messages' text (beyond trimming it); "
                     f"use special_tokens='refuse' or 'parse'")
