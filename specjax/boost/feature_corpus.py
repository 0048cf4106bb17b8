"""The feature drafter's corpus: the LLM's own continuations of prompts of several task kinds,
generated in resumable parts (``specjax.boost.corpus.generate_corpus`` shards, one directory per part).

Parts, in generation order (stage 2 quotes the passages part, so it comes first):

* ``passages``: articles, reports, meeting notes, blog posts written by the LLM (greedy);
* ``grounded-greedy`` / ``grounded-sampled``: summarisation, passage QA, retrieval over two
  documents, rewriting, translation and extraction prompts quoting those passages;
* ``tasks-greedy`` / ``tasks-sampled``: chat, explanation, QA, creative writing, comparisons,
  plans, math word problems and code (``specjax.boost.task_prompts``);
* with ``requests`` > 0, ``requests-written`` (the LLM writing user requests of many kinds,
  sampled; not training data) and ``requests`` (its greedy answers to the requests kept by
  ``specjax.boost.request_prompts.extract_request``): prompts worded as templates cannot word them;
* with ``more_requests`` > 0, a second round of the same (``requests-b-written``, ``requests-b``):
  other meta prompts and sampling seeds, kept requests already in the corpus dropped. A part of its
  own, so the first round's parts (and a drafter trained on them) stay as they were; which requests
  it keeps depends on the first round's, so a changed ``requests`` makes it a different part
  (its manifest guard refuses the old one);
* with ``written`` prompt files, ``written-greedy`` / ``written-sampled``: the LLM's continuations of
  prompts written for training outside the LLM (by people, or by a stronger model), a
  ``sampled_fraction`` of them at temperature 1 (seeded): worded as real requests are, with real
  passages to summarise, quote and translate, which neither templates nor a 135M model's own
  requests give. Prompts another part already holds, or a held-out one, are dropped; the part is
  split on its own, so the earlier parts (and a drafter trained on them) stay as they were;
* with ``more_written``, ``written_c``, ``written_d``, ... prompt files, later rounds of the same, each
  in parts of its own (``written-b-greedy`` / ``written-b-sampled``, ``written-c-greedy`` / ...: the
  parts, plan field, flag and seed offset of each round are its ``WRITTEN_ROUNDS`` entry): its own seeds
  and split; prompts of the earlier rounds are dropped. A later round is one more ``WRITTEN_ROUNDS``
  entry and plan field: its flag comes from the table.

Greedy parts match what greedy speculation sees; the sampled parts (temperature 1, seeded) keep
the drafter useful when requests sample. Prompts are sorted by length inside a part so a batch
pads little. ``provenance.json`` records what each part was made from and how long it took.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import NamedTuple

import numpy as np

from specjax.boost.corpus import generate_corpus, read_shard
from specjax.boost.request_prompts import extract_request, meta_prompts
from specjax.boost.runfiles import read_run_json
from specjax.boost.task_prompts import passage_prompts, stage1_prompts, stage2_prompts
from specjax.errors import InputError


@dataclasses.dataclass(frozen=True)
class CorpusPlan:
    passages: int = 1200
    tasks: int = 6400
    grounded: int = 2400
    sampled_fraction: float = 0.25  # of tasks and grounded prompts, at temperature 1
    max_new_tokens: int = 128
    passage_tokens: int = 160
    batch_size: int = 128
    seed: int = 0
    requests: int = 0  # requests the LLM is asked to write (self-instruct); about half are kept
    request_tokens: int = 64
    request_temperature: float = 0.8
    more_requests: int = 0  # a second round of self-written requests (other meta prompts and seeds)
    written: tuple[str, ...] = ()  # prompt files written for training (``written_prompts``)
    more_written: tuple[str, ...] = ()  # a second round of them, a part of its own
    written_c: tuple[str, ...] = ()  # a third round, parts of their own again
    written_d: tuple[str, ...] = ()  # a fourth round
    written_e: tuple[str, ...] = ()  # a fifth round
    written_f: tuple[str, ...] = ()  # a sixth round
    written_g: tuple[str, ...] = ()  # a seventh round

    def __post_init__(self):
        for name in ("passages", "tasks", "grounded", "max_new_tokens", "passage_tokens", "batch_size",
                     "request_tokens"):
            if getattr(self, name) < 1:
                raise InputError(f"corpus plan: {name} must be >= 1, got {getattr(self, name)}")
        if self.requests < 0 or self.more_requests < 0:
            raise InputError(f"corpus plan: requests and more_requests must be >= 0, got {self.requests}, "
                             f"{self.more_requests}")
        if not 0.0 < self.request_temperature <= 2.0:
            raise InputError(f"corpus plan: request_temperature must be in (0, 2], got {self.request_temperature}")
        for name in (r.files_field for r in WRITTEN_ROUNDS.values()):  # defined below; read at call time
            files = getattr(self, name)
            if isinstance(files, str) or not all(isinstance(p, str) for p in files):
                raise InputError(f"corpus plan: {name} must be a tuple of prompt file paths, got {files!r}")
        if not 0.0 <= self.sampled_fraction <= 1.0:
            raise InputError(f"corpus plan: sampled_fraction must be in [0, 1], got {self.sampled_fraction}")


PARTS = ("passages", "grounded-greedy", "grounded-sampled", "tasks-greedy", "tasks-sampled")


class RequestRound(NamedTuple):
    """A round of self-written requests: its parts (the written requests, not training data; the answers
    to those kept), the plan field that counts them, and its seed offset (meta prompts and sampling seeds
    are plan.seed plus this; the first round's as it always was)."""

    written: str
    answers: str
    count_field: str
    seed_offset: int


REQUEST_ROUNDS = {"requests": RequestRound("requests-written", "requests", "requests", 0),
                  "requests-b": RequestRound("requests-b-written", "requests-b", "more_requests", 1_000_003)}
REQUEST_PARTS = tuple(name for r in REQUEST_ROUNDS.values() for name in (r.written, r.answers))


class WrittenRound(NamedTuple):
    """A round of prompts written for training: its greedy and sampled parts, the plan field naming its
    files, its command-line flag, its seed offset (sampling seeds and the greedy / sampled split) and its
    ordinal (the flag's help)."""

    greedy: str
    sampled: str
    files_field: str
    flag: str
    seed_offset: int
    ordinal: str


WRITTEN_ROUNDS = {"written": WrittenRound("written-greedy", "written-sampled", "written", "--written-prompts",
                                          2_000_003, "first"),
                  "written-b": WrittenRound("written-b-greedy", "written-b-sampled", "more_written",
                                            "--more-written-prompts", 3_000_017, "second"),
                  "written-c": WrittenRound("written-c-greedy", "written-c-sampled", "written_c",
                                            "--written-c-prompts", 4_000_037, "third"),
                  "written-d": WrittenRound("written-d-greedy", "written-d-sampled", "written_d",
                                            "--written-d-prompts", 5_000_011, "fourth"),
                  "written-e": WrittenRound("written-e-greedy", "written-e-sampled", "written_e",
                                            "--written-e-prompts", 6_000_011, "fifth"),
                  "written-f": WrittenRound("written-f-greedy", "written-f-sampled", "written_f",
                                            "--written-f-prompts", 7_000_003, "sixth"),
                  "written-g": WrittenRound("written-g-greedy", "written-g-sampled", "written_g",
                                            "--written-g-prompts", 8_000_009, "seventh")}
WRITTEN_PARTS = tuple(name for r in WRITTEN_ROUNDS.values() for name in (r.greedy, r.sampled))


def part_recipe(plan: CorpusPlan, part: str) -> dict:
    """What a part's prompts depend on (its manifest guard): changing another part's size leaves it valid."""
    fields = {"passages": ("passages",), "grounded": ("passages", "grounded", "sampled_fraction"),
              "tasks": ("tasks", "sampled_fraction"),
              "requests": ("request_tokens", "request_temperature"),
              "written": ("sampled_fraction",)}[part.split("-")[0]]
    rounds = [r.count_field for r in REQUEST_ROUNDS.values() if part in (r.written, r.answers)]
    return {"part": part, "plan": {k: getattr(plan, k) for k in (*rounds, *fields)}}


def part_dirs(out_dir: str) -> dict[str, str]:
    return {name: os.path.join(out_dir, name) for name in PARTS + REQUEST_PARTS + WRITTEN_PARTS}


def build_feature_corpus(model, out_dir: str, plan: CorpusPlan = CorpusPlan(), exclude=(), progress: bool = True,
                         log=print) -> dict[str, list[str]]:
    """Generate (or resume) every part; returns {part: shard paths}."""
    os.makedirs(out_dir, exist_ok=True)
    dirs = part_dirs(out_dir)
    tpl = model.tokenizer

    def by_length(prompts):
        return sorted(prompts, key=lambda p: len(tpl.encode(p)))

    def run(name, prompts, temperature, max_new, recipe=None, seed=plan.seed, source=None):
        started = time.perf_counter()
        paths = generate_corpus(model, by_length(prompts), dirs[name], max_new_tokens=max_new,
                                batch_size=plan.batch_size, temperatures=(temperature,), seed=seed,
                                progress=progress, recipe={**part_recipe(plan, name), **(recipe or {})})
        _record(out_dir, name, len(prompts), temperature, time.perf_counter() - started, source)
        return paths

    shards = {}
    passages = passage_prompts(plan.passages, seed=plan.seed, exclude=exclude)
    topic_of = {p: t for t, p in passages}
    ordered = by_length(list(topic_of))  # the order generate_corpus writes the sequences in
    shards["passages"] = run("passages", ordered, 0.0, plan.passage_tokens)
    texts = _continuations(shards["passages"], tpl)
    if len(texts) != len(ordered):
        raise InputError(f"{dirs['passages']}: {len(texts)} sequences for {len(ordered)} prompts")
    topics_texts = [(topic_of[prompt], text) for prompt, text in zip(ordered, texts)]
    grounded = [p for _, p in stage2_prompts(topics_texts, plan.grounded, seed=plan.seed, exclude=exclude)]
    tasks = [p for _, p in stage1_prompts(plan.tasks, seed=plan.seed, exclude=exclude)]
    for name, prompts in (("grounded", grounded), ("tasks", tasks)):
        cut = round(len(prompts) * (1 - plan.sampled_fraction))
        shards[f"{name}-greedy"] = run(f"{name}-greedy", prompts[:cut], 0.0, plan.max_new_tokens)
        if cut < len(prompts):
            shards[f"{name}-sampled"] = run(f"{name}-sampled", prompts[cut:], 1.0, plan.max_new_tokens)
    taken = set(exclude) | set(ordered) | set(grounded) | set(tasks)
    for request_round in REQUEST_ROUNDS.values():
        if getattr(plan, request_round.count_field):
            taken |= set(_request_round(run, shards, request_round, plan, tpl, taken, dirs, log))
    for written_round in WRITTEN_ROUNDS.values():
        if getattr(plan, written_round.files_field):
            taken |= set(_written_parts(run, shards, plan, written_round, taken, log))
    log(f"corpus {out_dir}: {sum(len(v) for v in shards.values())} shards")
    return shards


def _request_round(run, shards: dict, request_round: RequestRound, plan: CorpusPlan, tokenizer, taken: set,
                   dirs: dict, log) -> list[str]:
    """One round of self-written requests: its count written (sampled), the usable ones not in ``taken``
    answered greedily into its answers part; returns the kept requests."""
    written_part, answers_part, count_field, seed_offset = request_round
    count, seed = getattr(plan, count_field), plan.seed + seed_offset
    written = run(written_part, [p for _, p in meta_prompts(count, seed=seed)], plan.request_temperature,
                  plan.request_tokens, seed=seed)
    # a request equal to a template prompt (or to one of an earlier round) would be the same greedy sequence
    # in two parts, which are split apart (``feature_tune``): held out in one, trained on in the other
    kept = [r for r in dict.fromkeys(filter(None, map(extract_request, _continuations(written, tokenizer))))
            if r not in taken]
    if not kept:
        raise InputError(f"{dirs[written_part]}: none of the {count} written requests was usable; remove that "
                         f"directory and ask for more")
    log(f"{answers_part}: kept {len(kept)} of {count} written")
    # the kept requests depend on extract_request and the held-out prompts too: the manifest names them
    digest = hashlib.sha256(json.dumps(kept).encode()).hexdigest()
    shards[answers_part] = run(answers_part, kept, 0.0, plan.max_new_tokens, recipe={"requests_sha256": digest},
                               seed=seed)
    return kept


def written_prompts(paths, taken=(), flag: str = "--written-prompts") -> list[str]:
    """The distinct prompts of written prompt files, in file order, without those in ``taken`` (held out,
    or already another part's: the same greedy sequence in two parts split apart could be held out in one
    and trained on in the other). Refused when none is left."""
    from specjax.io.prompts import read_prompts_file

    taken = set(taken)
    every = [p for path in paths for p in read_prompts_file(path, flag=flag, allow_token_ids=False, plain_lines=True)]
    kept = [p for p in dict.fromkeys(every) if p not in taken]
    if not kept:
        raise InputError(f"{flag} {', '.join(paths)}: no prompt left ({len(every)} read, all held out or already "
                         f"in the corpus)")
    return kept


def split_written(prompts: list[str], plan: CorpusPlan, seed_offset: int) -> tuple[list[str], list[str]]:
    """(greedy, sampled): a seeded ``sampled_fraction`` of a round's prompts is continued at temperature 1."""
    order = np.random.RandomState(plan.seed + seed_offset).permutation(len(prompts))
    cut = round(len(prompts) * (1 - plan.sampled_fraction))
    return [prompts[i] for i in sorted(order[:cut])], [prompts[i] for i in sorted(order[cut:])]


def _written_parts(run, shards: dict, plan: CorpusPlan, written_round: WrittenRound, taken: set, log) -> list[str]:
    """One round of written prompts continued into its parts; returns its prompts."""
    files = getattr(plan, written_round.files_field)
    prompts = written_prompts(files, taken, flag=written_round.flag)
    greedy, sampled = split_written(prompts, plan, written_round.seed_offset)
    log(f"{written_round.greedy.removesuffix('-greedy')}: {len(prompts)} prompts ({len(greedy)} greedy, "
        f"{len(sampled)} sampled)")
    # the manifests name the prompts by hash: the files' paths may move, their content may not change
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    source = (f"prompts written for training ({', '.join(os.path.basename(p) for p in files)}: by people or "
              f"a stronger model, not by the LLM)")
    seed = plan.seed + written_round.seed_offset
    for name, part, temperature in ((written_round.greedy, greedy, 0.0), (written_round.sampled, sampled, 1.0)):
        if part:
            shards[name] = run(name, part, temperature, plan.max_new_tokens, recipe={"written_sha256": digest},
                               seed=seed, source=source)
    return prompts


def _continuations(paths, tokenizer) -> list[str]:
    """The continuation text of every sequence of a part, in generation order."""
    return [tokenizer.decode(ids[prompt_len:], skip_special_tokens=True)
            for path in paths for ids, prompt_len in read_shard(path)]


def _record(out_dir: str, part: str, num_prompts: int, temperature: float, seconds: float,
            source: str | None = None) -> None:
    path = os.path.join(out_dir, "provenance.json")
    record = read_run_json(path, "remove it (it records where the corpus's parts came from; they are "
                                 "recorded again as they are made)") if os.path.exists(path) else {}
    entry = record.get(part, {"seconds": 0.0})
    made = source or ("specjax.boost.request_prompts: the LLM writing requests (sampled), then the kept ones"
                      if part.startswith("requests") else
                      "specjax.boost.task_prompts (templates x topics, seeded numbers)")
    entry.update(prompts=num_prompts, temperature=temperature, seconds=entry["seconds"] + seconds,
                 source=f"{made}; the LLM's own continuations via specjax.generate(mode='incremental')")
    record[part] = entry
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)
