"""The OpenAI completions and chat completions requests: checked field by field, turned into a
token-level ``Submission``; errors in OpenAI's shape.

Status codes: 400 for a malformed body or a value out of range (and unsupported features such as
``n`` > 1, refused by name, never ignored), 422 for a field of the wrong JSON type, 404 for an
unknown model, 413 for a body over the server's byte limit, 429 for a full queue, 503 while shutting
down. Every message names the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import sys

from specjax.decoding.sampling import MAX_TEMPERATURE, MIN_TEMPERATURE, MIN_TOP_P, SamplingParams
from specjax.errors import InputError
from specjax.io.detokenize import IncrementalText
from specjax.io.prompts import check_text
from specjax.io.special_tokens import encode_chat, encode_text
from specjax.serving.scheduler import Submission


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # far above any prompt of --max-prompt-tokens' default 2048 tokens


@dataclasses.dataclass(frozen=True)
class Limits:
    """What this server takes: the engine's sizes and the model's context window."""

    model_name: str
    max_prompt_tokens: int
    max_tokens: int  # the engine's max_new_tokens
    context_window: int
    max_stop_tokens: int  # the engine's stop-id slots
    # A body past it is refused unread (413): reading and tokenizing it would cost memory and a worker's
    # time before the prompt's token count could refuse it (10M characters take about 7.5 s to tokenize).
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # What a special token's string inside a prompt's or message's text becomes (specjax.io.special_tokens).
    special_tokens: str = "parse"


@dataclasses.dataclass(frozen=True)
class Parsed:
    submission: Submission
    stop_strings: tuple[str, ...]
    stream: bool
    include_usage: bool
    chat: bool


_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "user",
           "n"}
_COMPLETION = _COMMON | {"prompt"}
_CHAT = _COMMON | {"messages", "max_completion_tokens"}
# Fields OpenAI defines that this server does not implement: accepted only at their neutral value.
_NEUTRAL = {"best_of": (1,), "echo": (False,), "logprobs": (None, False), "top_logprobs": (None, 0),
            "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": (None, {}), "suffix": (None,),
            "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"})}
MAX_STOP_STRINGS = 4  # OpenAI's limit
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default max_tokens of /v1/completions


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:  # ValueError: JSONDecodeError, and ints past 4300 digits
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:  # nesting deeper than the parser's recursion
        raise APIError(400, "the request body is not valid JSON (nested too deeply)") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _type_error(param: str, want: str, value) -> APIError:
    return APIError(422, f"'{param}' must be {want}, got {json.dumps(value)[:80]}", param=param, code="invalid_type")


def _int(body: dict, key: str):
    v = body.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise _type_error(key, "an integer", v)
    return v


_FLOAT_MAX = sys.float_info.max


def _number(body: dict, key: str):
    v = body.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise _type_error(key, "a number", v)
    if v is not None and (abs(v) > _FLOAT_MAX or not math.isfinite(v)):  # an int past float's range
        raise APIError(400, f"'{key}' must be finite, got {json.dumps(v)[:80]}", param=key)
    return v


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(key, "a boolean", v)
    return v


def _check_fields(body: dict, allowed: set[str]) -> None:
    for key, value in body.items():
        if value is None:  # null means "not given" (the openai client sends explicit None as null)
            continue
        if key in _NEUTRAL:
            if value not in _NEUTRAL[key]:
                raise APIError(400, f"'{key}' is not supported by this server (only {_NEUTRAL[key][0]!r})",
                               param=key, code="unsupported_parameter")
        elif key not in allowed:
            raise APIError(400, f"unknown or unsupported field '{key}'", param=key, code="unsupported_parameter")
    n = _int(body, "n")
    if n is not None and n != 1:
        raise APIError(400, f"'n' must be 1 (one choice per request), got {n}; send {n} requests instead",
                       param="n", code="unsupported_parameter")


def _model(body: dict, limits: Limits) -> None:
    if body.get("model") is None:  # null means "not given", as for every field
        raise APIError(400, "'model' is required", param="model")
    name = body["model"]
    if not isinstance(name, str):
        raise _type_error("model", "a string", name)
    if name != limits.model_name:
        raise APIError(404, f"the model '{name}' does not exist here; this server serves '{limits.model_name}'",
                       type="invalid_request_error", param="model", code="model_not_found")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _type_error("stop", "a string or a list of strings", stop)
    if len(stops) > MAX_STOP_STRINGS or any(s == "" for s in stops):
        raise APIError(400, f"'stop' takes 1 to {MAX_STOP_STRINGS} non-empty strings, got {stops!r}", param="stop")
    return tuple(stops)


def _sampling(body: dict) -> SamplingParams:
    temperature = _number(body, "temperature")
    top_p, top_k, seed = _number(body, "top_p"), _int(body, "top_k"), _int(body, "seed")
    temperature = 1.0 if temperature is None else float(temperature)  # OpenAI's default
    if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise APIError(400, f"'temperature' must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, inf), got {temperature}",
                       param="temperature")
    if temperature > MAX_TEMPERATURE:  # held in float32 on the device
        raise APIError(400, f"'temperature' must be at most {MAX_TEMPERATURE:.4g} (float32's largest), got "
                            f"{temperature}", param="temperature")
    if top_p is not None and not 0 < top_p <= 1:
        raise APIError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    if top_p is not None and top_p < MIN_TOP_P:  # 0 as the device's float32: no token would be kept
        raise APIError(400, f"'top_p' must be at least {MIN_TOP_P:.3g} (float32's smallest normal number), got "
                            f"{top_p}", param="top_p")
    if top_k is not None and not 0 <= top_k < 2**31:
        raise APIError(400, f"'top_k' must be in [0, 2**31) (0 = off), got {top_k}", param="top_k")
    if seed is not None and not 0 <= seed < 2**31:
        raise APIError(400, f"'seed' must be in [0, 2**31), got {seed}", param="seed")
    if seed is None:  # a sampled request without a seed still gets one: every request is reproducible in the logs
        seed = secrets.randbelow(2**31)
    return SamplingParams(temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else float(top_p),
                          seed=seed)


def _completion_prompt(body: dict, tokenizer, special_tokens: str) -> list[int]:
    if body.get("prompt") is None:  # null means "not given", as for every field
        raise APIError(400, "'prompt' is required", param="prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one prompt
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        raise APIError(400, f"'prompt' holds {len(p)} prompts; this server takes one prompt per request",
                       param="prompt", code="unsupported_parameter")
    if isinstance(p, str):
        if p == "":
            raise APIError(400, "'prompt' is empty", param="prompt")
        _check_text(p, "'prompt'", "prompt")
        try:
            ids = encode_text(tokenizer, p, special_tokens, "'prompt'")
        except InputError as e:  # special_tokens="refuse"
            raise APIError(400, str(e), param="prompt", code="special_token_in_prompt") from None
        except Exception as e:  # noqa: BLE001 - the tokenizer's own message says what it could not encode
            raise APIError(400, f"'prompt' could not be tokenized: {type(e).__name__}: {e}", param="prompt") from None
    elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if not p:
            raise APIError(400, "'prompt' is empty", param="prompt")
        ids = p
    else:
        raise _type_error("prompt", "a string or a list of token ids", p)
    if not ids:
        raise APIError(400, "'prompt' encodes to no tokens", param="prompt")
    return [int(t) for t in ids]


def _check_text(text: str, label: str, param: str) -> None:
    try:
        check_text(text, label)
    except InputError as e:  # JSON can carry a lone surrogate ("\ud800")
        raise APIError(400, str(e), param=param) from None


_ROLES = ("system", "user", "assistant")


def _chat_prompt(body: dict, tokenizer, special_tokens: str) -> list[int]:
    if body.get("messages") is None:  # null means "not given", as for every field
        raise APIError(400, "'messages' is required", param="messages")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise _type_error("messages", "a list of messages", messages)
    if not messages:
        raise APIError(400, "'messages' is empty", param="messages")
    plain = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _type_error(where, "an object with a string 'role'", m)
        if m["role"] not in _ROLES:
            raise APIError(400, f"{where}.role must be one of {list(_ROLES)}, got {m['role']!r}", param=where)
        extra = {k for k, v in m.items() if v is not None} - {"role", "content"}  # a name: the template has no place
        if extra:
            raise APIError(400, f"{where}: unsupported field(s) {sorted(extra)}", param=where,
                           code="unsupported_parameter")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise APIError(400, f"{where}.content: only text parts are supported", param=where,
                               code="unsupported_parameter")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise _type_error(f"{where}.content", "a string or a list of text parts", content)
        _check_text(content, f"'{where}.content'", where)
        plain.append({"role": m["role"], "content": content})
    if all(m["content"] == "" for m in plain):
        raise APIError(400, "'messages' hold no text", param="messages")
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    try:
        ids = encode_chat(tokenizer, plain, special_tokens, "'messages'",
                          [f"'messages[{i}].content'" for i in range(len(plain))])
    except InputError as e:  # special_tokens="refuse", or a template that "text" cannot split
        raise APIError(400, str(e), param="messages", code="special_token_in_prompt") from None
    except Exception as e:  # noqa: BLE001 - templates refuse conversations in their own words (jinja raise_exception)
        raise APIError(400, f"the model's chat template refused 'messages': {type(e).__name__}: {e}",
                       param="messages") from None
    return [int(t) for t in ids]


def parse_request(body: dict, *, chat: bool, limits: Limits, tokenizer, vocab: int, stop_ids: tuple[int, ...]) \
        -> Parsed:
    """A completions (``chat=False``) or chat completions body -> what the scheduler runs."""
    _check_fields(body, _CHAT if chat else _COMPLETION)
    _model(body, limits)
    sampling = _sampling(body)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    if options and not stream:
        raise APIError(400, "'stream_options' needs 'stream': true", param="stream_options")
    include_usage = _bool(options or {}, "include_usage", False)
    if options and set(options) - {"include_usage"}:
        raise APIError(400, f"'stream_options' takes only include_usage, got {sorted(options)}",
                       param="stream_options", code="unsupported_parameter")
    stop_strings = _stop(body)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key)
    if key != "max_tokens":
        _int(body, "max_tokens")  # max_completion_tokens wins, but the other is still checked, not ignored
    ids = (_chat_prompt(body, tokenizer, limits.special_tokens) if chat
           else _completion_prompt(body, tokenizer, limits.special_tokens))
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:  # given ids, or a tokenizer with more (added) tokens than the model's embedding rows
        field = "messages" if chat else "prompt"
        raise APIError(400, f"'{field}' holds token id {bad[0]}, outside the model's vocabulary [0, {vocab})",
                       param=field)
    if max_tokens is not None and max_tokens <= 0:
        raise APIError(400, f"'{key}' must be >= 1, got {max_tokens}", param=key)
    if len(ids) + (max_tokens or 1) > limits.context_window:
        raise APIError(400, f"the prompt ({len(ids)} tokens) plus '{key}' ({max_tokens or 1}) exceeds the model's "
                       f"context window of {limits.context_window} tokens", param=key if max_tokens else "prompt",
                       code="context_length_exceeded")
    if len(ids) > limits.max_prompt_tokens:
        raise APIError(400, f"the prompt has {len(ids)} tokens; this server takes at most {limits.max_prompt_tokens} "
                       f"(specjax serve --max-prompt-tokens)", param="messages" if chat else "prompt",
                       code="context_length_exceeded")
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise APIError(400, f"'{key}' is {max_tokens}; this server generates at most {limits.max_tokens} tokens per "
                       f"request (specjax serve --max-tokens)", param=key)
    if max_tokens is None:  # OpenAI's defaults: 16 for completions; chat as much as the server and the context allow
        default = limits.max_tokens if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, limits.max_tokens)
        max_tokens = min(default, limits.context_window - len(ids))
    submission = Submission(prompt=ids, sampling=sampling, max_new_tokens=max_tokens, stop_ids=stop_ids)
    return Parsed(submission, stop_strings, stream, include_usage, chat)


class TextTracker:
    """The client's text of one request: the generated tokens decoded incrementally (after the prompt's last
    tokens, so the first word keeps its leading space; ``specjax.io.detokenize``), cut at the first stop
    string, holding back what may still become a stop string or is an unfinished UTF-8 character."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...], prompt_ids=()):
        self.decoder = IncrementalText(tokenizer, prompt_ids)
        self.stops = stop_strings
        self.sent = 0  # characters already given to the client
        self.stopped = False  # a stop string was found; later tokens are not the client's
        self.served_tokens = 0  # tokens behind the client's text (up to the stop string's last token)

    def feed(self, ids: list[int]) -> str:
        """The new text to send after ``ids`` (maybe empty; always, once a stop string was found)."""
        if self.stopped:
            return ""
        for t in ids:  # token by token: the stop string's last token bounds the tokens served
            self.served_tokens += 1
            if self.decoder.add(t) and self.stops:
                cut = self._first_stop(self.decoder.text)
                if cut is not None:
                    self.stopped = True
                    return self._take(self.decoder.text[:cut])
        return self._take(self._hold_stop_prefix(self.decoder.text))

    def finish(self) -> str:
        """The held-back rest once the request ended without a stop string."""
        if self.stopped:
            return ""
        self.decoder.flush()
        return self._take(self.decoder.text)

    def _first_stop(self, text: str) -> int | None:
        start = max(0, self.sent - max((len(s) for s in self.stops), default=0))
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _hold_stop_prefix(self, text: str) -> str:
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return text[:len(text) - hold]

    def _take(self, text: str) -> str:
        new = text[self.sent:] if len(text) > self.sent else ""
        self.sent = max(self.sent, len(text))
        return new
