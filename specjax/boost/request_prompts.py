"""User requests written by the LLM itself ("self-instruct"), for the feature drafter's corpus.

Why: a drafter trained on templated prompts learns their answers' templated openings. Measured on
the shared dev prompts (hand-written, 78, 128 tokens), the drafter trained on template prompts agrees
with the LLM at depth 1 on 0.41 of positions, against 0.53 on held-out template prompts. With no text
corpus on this machine, the LLM is asked to *write* requests of many kinds (questions, role-play,
estimates, what-ifs, advice, writing and coding tasks) by several kinds of users about many topics;
sampled, so they vary in wording as templates cannot. Its outputs are messy (a preamble, the request
in quotes, a label, an answer instead of a request): ``extract_request`` keeps one clean request or
rejects the output. The corpus then holds the LLM's greedy answers to the kept requests.
"""

from __future__ import annotations

import re

import numpy as np

from specjax.boost.task_prompts import TOPICS

WRITERS = ["a student", "a parent", "a software developer", "a small-business owner", "a retired teacher",
           "a nurse", "a traveller", "a curious teenager", "a manager", "a scientist", "a writer", "a chef",
           "someone new to a city", "a job seeker", "a gardener", "a history fan"]
# {w}: who asks, {t}: the topic. Kinds follow what people ask assistants: how-to and advice, knowledge,
# explanations, role-play, estimates, what-ifs, common sense, opinions, writing and code
META = {
    "how-to": "Write a question that {w} might ask an AI assistant about how to do something related to {t}.",
    "advice": "Write a message in which {w} asks an AI assistant for advice about a problem involving {t}.",
    "knowledge": "Write a question about {t} that {w} might ask, one that needs a detailed answer.",
    "explain": "Write a request in which {w} asks an AI assistant to explain something about {t}.",
    "roleplay": "Write an instruction that asks an AI assistant to pretend to be a character connected to {t} "
                "and answer as that character.",
    "estimate": "Write a question that asks for a rough numerical estimate about {t}, with the reasoning shown.",
    "what-if": "Write a 'what if' question about {t} that imagines history or the world going differently.",
    "common-sense": "Write an everyday question about {t} that needs common sense to answer.",
    "opinion": "Write a question that asks an AI assistant to compare two options related to {t} and recommend one.",
    "writing": "Write a request in which {w} asks an AI assistant to write something (an email, a speech, a "
               "story, a poem or a post) about {t}.",
    "code": "Write a request in which {w} asks an AI assistant for a short program or script that helps with {t}.",
    "list": "Write a request in which {w} asks an AI assistant for a list of ideas or steps about {t}.",
}
SUFFIX = " Reply with the request only."
MIN_WORDS, MAX_WORDS = 4, 70
_LABEL = re.compile(r"^(?:\*\*)?(?:question|request|instruction|prompt|user|message|query|q)\s*\d*\s*(?:\*\*)?\s*:\s*",
                    re.IGNORECASE)
_PREAMBLE = re.compile(r"^(?:sure|here|certainly|okay|of course|absolutely)\b", re.IGNORECASE)
_REFUSAL = re.compile(r"^(?:i'm sorry|i am sorry|as an ai|i cannot|i can't)", re.IGNORECASE)
_QUOTED = re.compile(r"[\"\u201c]([^\"\u201d]{10,})[\"\u201d]")


def meta_prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` seeded (kind, prompt asking the LLM to write a request) pairs."""
    rng = np.random.RandomState(seed + 3)  # its own stream: task_prompts draws with seed + 0, 1, 2
    kinds = list(META)
    out = []
    for _ in range(n):
        kind = kinds[rng.randint(len(kinds))]
        out.append((kind, META[kind].format(w=WRITERS[rng.randint(len(WRITERS))],
                                            t=TOPICS[rng.randint(len(TOPICS))]) + SUFFIX))
    return out


def extract_request(text: str) -> str | None:
    """The request in one LLM output, or None: the first quoted passage of 10+ characters if there is
    one, else the first paragraph after a preamble line ("Sure, here's ...:"), a label ("Question:")
    stripped; rejected if it is a refusal, has under 4 or over 70 words, is mostly not ASCII, or stops
    mid-sentence (generation cut it off)."""
    text = text.strip()
    quoted = _QUOTED.search(text)
    if quoted:
        candidate = quoted.group(1)
    else:
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
        if paragraphs and _PREAMBLE.match(paragraphs[0]) and paragraphs[0].rstrip().endswith(":"):
            paragraphs = paragraphs[1:]
        if not paragraphs:
            return None
        candidate = paragraphs[0]
    candidate = _LABEL.sub("", candidate.strip()).strip().strip("*").strip()
    words = candidate.split()
    if not MIN_WORDS <= len(words) <= MAX_WORDS or _REFUSAL.match(candidate) or _PREAMBLE.match(candidate):
        return None
    if sum(c.isascii() for c in candidate) < 0.9 * len(candidate) or candidate[-1] not in ".?!":
        return None
    return candidate
