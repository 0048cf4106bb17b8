"""Prompts at the boundary: one reader for prompt files and one check for prompts given to the API.

A prompt is text (``str``, valid UTF-8) or an explicit list of token ids (ints, not bools). Anything
else is refused with an ``InputError`` naming the prompt (or the file and line): no ``None`` turned
into the text "None", no ``bytes`` read as token ids, no booleans taken for ids 0 and 1.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np

from specjax.decoding.contract import host_value
from specjax.errors import InputError


def _is_token_id(t) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))


def _is_token_list(p) -> bool:
    if isinstance(p, np.ndarray):
        return p.ndim == 1 and p.dtype.kind in "iu"
    return isinstance(p, (list, tuple)) and all(_is_token_id(t) for t in p)


def check_text(text: str, where: str) -> str:
    """``text`` if it is valid Unicode that encodes to UTF-8 (argv and files decoded with
    surrogateescape carry undecodable bytes as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        try:  # undecodable bytes, carried as U+DC80..U+DCFF
            bad = f"bytes {text[e.start:e.end].encode('utf-8', 'surrogateescape')!r}"
        except UnicodeEncodeError:  # a lone surrogate of another kind (JSON's "\ud800", a str built in Python)
            bad = "lone surrogate " + ", ".join(f"U+{ord(c):04X}" for c in text[e.start:e.end])
        raise InputError(f"{where} is not valid UTF-8 text ({bad} at character {e.start})") from None
    return text


def prompt_labels(labels, n: int) -> list[str]:
    """What errors call each of ``n`` prompts: ``labels`` (a file's ``path:line``, say) or "prompt i"."""
    if labels is None:
        return [f"prompt {i}" for i in range(n)]
    if isinstance(labels, str) or len(labels) != n or not all(isinstance(x, str) for x in labels):
        raise InputError(f"labels must be a list of {n} strings (one per prompt), got {labels!r:.80}")
    return list(labels)


def normalize_prompts(prompts, labels=None) -> list:
    """Strings or token-id lists -> a non-empty list of them (a single prompt is wrapped), checked.
    ``labels``: what errors call each prompt (default "prompt i"). Concrete JAX arrays are taken as NumPy."""
    prompts = host_value(prompts, "prompts")
    if isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes, bytearray)):
        prompts = [host_value(p, "a prompt") for p in prompts]
    if isinstance(prompts, str) or (_is_token_list(prompts) and len(prompts) > 0):
        prompts = [prompts]
    if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(prompts, (Sequence, np.ndarray)) \
            or len(prompts) == 0:
        raise InputError(f"prompts must be a non-empty list of strings or of token-id lists, got "
                         f"{type(prompts).__name__}")
    out = []
    for label, p in zip(prompt_labels(labels, len(prompts)), prompts):
        if isinstance(p, str):
            if not p:  # a chat template would wrap it into a conversation nobody wrote
                raise InputError(f"{label} is empty")
            out.append(check_text(p, label))
        elif isinstance(p, (bytes, bytearray)):
            raise InputError(f"{label} is bytes: decode it to a str, or pass token ids as a list of ints")
        elif _is_token_list(p):
            out.append([int(t) for t in p])
        elif isinstance(p, (list, tuple, np.ndarray)):
            bad = next((t for t in p if not _is_token_id(t)), None) if not isinstance(p, np.ndarray) else p.dtype
            raise InputError(f"{label}: a token-id list must hold ints only, found {bad!r}")
        else:
            raise InputError(f"{label} must be a str or a list of token ids, got {type(p).__name__} {p!r}")
    return out


def read_prompts_file(path: str, *, flag: str = "--prompts-file", allow_token_ids: bool = True,
                      plain_lines: bool = False) -> list:
    """Prompts of a JSONL file, one ``{"prompt": TEXT}`` (or ``{"prompt": [ids]}`` when
    ``allow_token_ids``) per non-blank line. ``plain_lines``: a file not ending in .jsonl holds one
    text prompt per line instead. Every problem names the file and the line."""
    return [r["prompt"] for r in read_prompt_records(path, flag=flag, allow_token_ids=allow_token_ids,
                                                      plain_lines=plain_lines)]


def read_labelled_prompts(path: str, *, flag: str = "--prompts-file") -> tuple[list, list[str]]:
    """(prompts, labels) of a prompts file (see ``read_prompts_file``): each label is the prompt's
    ``path:line``, for errors found later (a prompt too long for the context, an id outside the vocabulary)."""
    lines = []
    records = read_prompt_records(path, flag=flag, lines=lines)
    return [r["prompt"] for r in records], [f"{path}:{n}" for n in lines]


def read_prompt_records(path: str, *, flag: str = "--prompts-file", allow_token_ids: bool = True,
                        plain_lines: bool = False, lines: list | None = None) -> list[dict]:
    """The records of a prompts file (see ``read_prompts_file``): each a dict with a validated
    ``"prompt"`` and whatever other keys the line holds (``id``, ``category``, ...). ``lines``: a list
    that receives each record's line number."""
    where = f"{flag} {path}"
    if os.path.isdir(path):
        raise InputError(f"{where}: is a directory, expected a file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise InputError(f"{where}: prompts file not found") from None
    except OSError as e:
        raise InputError(f"{where}: cannot read ({e.strerror or e})") from None
    jsonl = not plain_lines or path.endswith(".jsonl")
    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark (Notepad, PowerShell's utf8) is no text
    prompts = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        try:
            text = line.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as e:
            raise InputError(f"{path}:{n}: not valid UTF-8 (byte {line[e.start:e.start + 1]!r} at column "
                             f"{e.start + 1})") from None
        if not text.strip():
            continue
        if lines is not None:
            lines.append(n)
        if not jsonl:
            prompts.append({"prompt": text})
            continue
        try:
            record, invalid = json.loads(text), None
        except ValueError as e:  # JSONDecodeError, and integers of more than 4300 digits
            record, invalid = None, f"the line is not valid JSON ({e})"
        except RecursionError:
            record, invalid = None, "the line is not valid JSON (nested too deeply)"
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if isinstance(prompt, str) and prompt:
            prompts.append(dict(record, prompt=check_text(prompt, f"{path}:{n}: 'prompt'")))
        elif allow_token_ids and isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
            prompts.append(dict(record, prompt=[int(t) for t in prompt]))
        else:
            kinds = "a non-empty string or a list of token ids (ints)" if allow_token_ids else "a non-empty string"
            if invalid:
                got = invalid
            elif not isinstance(record, dict):
                got = "the line is not a JSON object"
            elif "prompt" not in record:
                got = "it has no 'prompt' key"
            else:
                got = f"'prompt' is {json.dumps(prompt)[:60]}"
            raise InputError(f"{path}:{n}: expected a JSON object whose 'prompt' is {kinds}; {got}")
    if not prompts:
        raise InputError(f"{where}: no prompts in the file")
    return prompts
