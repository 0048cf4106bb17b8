"""Boost-tuning data: training prompts and the LLM's own continuations (first piece of the
learning-based speculator; training and the SSM pool build on the corpus written here).

Training prompts are synthesised from templates x topics written for specjax, so the shared dev
prompts stay held out for evaluation. Continuations come from specjax's own batch generation
(incremental decoding: exactly the LLM's greedy / seeded-sampled tokens), written as resumable
shards: re-running with the same arguments skips the shards already on disk.
"""

from __future__ import annotations

import json
import os
import zipfile

import numpy as np

from specjax.api import encode_prompts, generate
from specjax.boost.runfiles import read_run_json
from specjax.decoding.sampling import SamplingParams
from specjax.errors import InputError
from specjax.models.params import llm_weights_digest

TEMPLATES = {
    "generic": ["What are some practical ways to get better at {t}?", "Give me advice about {t} for a beginner.",
                "What are the pros and cons of {t}?"],
    "knowledge": ["Explain how {t} works.", "What is the history of {t}?", "Why does {t} matter?"],
    "roleplay": ["You are an expert in {t}. Introduce yourself to a new student.",
                 "Pretend you are a tour guide who loves {t}. Describe your favourite day."],
    "common-sense": ["How can you tell whether someone is really interested in {t}?",
                     "What would people notice first if {t} suddenly disappeared?"],
    "fermi": ["Estimate how many people in the world work on {t}. Explain your reasoning step by step.",
              "Roughly how much money is spent on {t} every year? Walk through the estimate."],
    "counterfactual": ["What if {t} had never been invented?", "How would daily life change if {t} were free?"],
    "coding": ["Write a Python function related to {t} and explain it.",
               "Describe a simple program that could help with {t}, with pseudocode."],
    "math": ["Make up a word problem about {t} and solve it step by step.",
             "Explain a piece of mathematics that is useful for {t}."],
    "writing": ["Write a short poem about {t}.", "Write a persuasive paragraph about {t}.",
                "Draft a friendly email inviting a colleague to a workshop on {t}."],
}
TOPICS = ["gardening", "time management", "renewable energy", "the printing press", "public speaking", "chess",
          "machine learning", "volcanoes", "cooking pasta", "personal finance", "bird migration", "the internet",
          "marathon training", "ancient Rome", "electric cars", "photography", "sleep", "coffee", "space travel",
          "learning a language", "climate change", "jazz music", "bicycles", "vaccines", "city planning",
          "board games", "honey bees", "recycling", "smartphones", "meditation", "the ocean", "libraries",
          "video games", "baking bread", "mountain climbing", "databases", "solar panels", "painting", "trains",
          "friendship", "budget travel", "weather forecasting", "origami", "robotics", "tea", "volunteering",
          "the moon", "podcasts", "architecture", "rainforests", "3D printing", "running a small business",
          "birdwatching", "cryptography", "nutrition", "the Olympic Games", "remote work", "earthquakes",
          "classical music", "dinosaurs"]


def training_prompts(n: int, seed: int = 0, exclude=()) -> list[str]:
    """``n`` distinct synthetic prompts in a seeded order, none of them in ``exclude``."""
    every = [tpl.format(t=topic) for templates in TEMPLATES.values() for tpl in templates for topic in TOPICS]
    held_out = set(exclude)
    pool = [p for p in every if p not in held_out]
    if n > len(pool):
        raise InputError(f"asked for {n} training prompts, the templates give {len(pool)}")
    order = np.random.RandomState(seed).permutation(len(pool))
    return [pool[i] for i in order[:n]]


def generate_corpus(model, prompts, out_dir: str, *, max_new_tokens: int = 128, batch_size: int = 32,
                    temperatures=(0.0, 1.0), seed: int = 0, chat_template: bool = True, progress: bool = True,
                    recipe: dict | None = None) -> list[str]:
    """The LLM's continuations of every prompt at every temperature, as shards
    ``out_dir/shard-XXXXX.npz`` (tokens = prompt + continuation, concatenated, with offsets and prompt
    lengths). Request i of a shard samples with seed ``seed + global request index``. Returns the shard paths."""

    if not prompts:
        raise InputError("generate_corpus: no prompts")
    if batch_size < 1 or max_new_tokens < 1:
        raise InputError(f"batch_size and max_new_tokens must be >= 1, got {batch_size}, {max_new_tokens}")
    os.makedirs(out_dir, exist_ok=True)
    manifest = {"num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "batch_size": batch_size,
                "temperatures": list(temperatures), "seed": seed, "chat_template": chat_template, **(recipe or {})}
    manifest_path = os.path.join(out_dir, "manifest.json")
    weights = llm_weights_digest(model.params)
    if os.path.exists(manifest_path):
        existing = read_run_json(manifest_path, "use another corpus directory, or remove this part to make it again")
        made_by = existing.pop("weights", None)
        if existing != manifest:
            raise InputError(f"{manifest_path}: the corpus there was made with {existing}, not {manifest}; "
                             f"use another directory")
        if made_by is not None and made_by != weights:
            raise InputError(f"{manifest_path}: the corpus there was generated by other weights (digest "
                             f"{made_by[:12]}, this model's is {weights[:12]}: another checkpoint of the same "
                             f"config, e.g. a fine-tune); use another directory")
    if not os.path.exists(manifest_path) or made_by is None:
        # a corpus from before the digest was recorded is taken as this model's, as it was before, and named so
        with open(manifest_path + ".tmp", "w") as f:
            json.dump({**manifest, "weights": weights}, f, indent=1)
        os.replace(manifest_path + ".tmp", manifest_path)
    jobs = [(t, i) for t in temperatures for i in range(0, len(prompts), batch_size)]
    paths = [os.path.join(out_dir, f"shard-{index:05d}.npz") for index in range(len(jobs))]
    for path, (_, start) in zip(paths, jobs):  # before any generation: every reused shard is from these prompts
        if os.path.exists(path):
            _check_shard_prompts(path, encode_prompts(model, prompts[start:start + batch_size], chat_template))
    from tqdm import tqdm

    bar = tqdm(jobs, desc=f"LLM continuations ({os.path.basename(os.path.normpath(out_dir))})", disable=not progress)
    for index, (temperature, start) in enumerate(bar):
        path = paths[index]
        if os.path.exists(path):
            continue  # resumable: this shard was written by an earlier run (checked above)
        batch = prompts[start:start + batch_size]
        first = seed + index * batch_size
        sampling = [SamplingParams(temperature=temperature, seed=first + j) for j in range(len(batch))]
        result = generate(model, batch, max_new_tokens=max_new_tokens, sampling=sampling,
                                  chat_template=chat_template, mode="incremental")
        seqs = [p + c for p, c in zip(result.prompt_token_ids, result.token_ids)]
        offsets = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)
        tmp = path + ".tmp.npz"
        np.savez(tmp, tokens=np.concatenate(seqs).astype(np.int32), offsets=offsets,
                 prompt_lens=np.array([len(p) for p in result.prompt_token_ids], np.int32),
                 temperature=np.float32(temperature), seeds=np.arange(first, first + len(batch), dtype=np.int64))
        os.replace(tmp, path)  # a shard is either complete or absent
    return paths


def _check_shard_prompts(path: str, expected: list[list[int]]) -> None:
    """Refuse a shard made from other prompts: the manifest counts prompts but does not name them, so a
    changed held-out list (``--exclude-prompts``) of the same size would otherwise reuse shards that
    may hold the prompts now held out."""
    made = [seq[:n] for seq, n in read_shard(path)]
    if made != expected:
        which = next((i for i, (a, b) in enumerate(zip(made, expected)) if a != b), min(len(made), len(expected)))
        raise InputError(f"{path}: made from other prompts than this run's (request {which} of the shard differs; "
                         f"{len(made)} prompts there, {len(expected)} here), e.g. after a changed held-out list; "
                         f"use another directory")


def read_shard(path: str) -> list[tuple[list[int], int]]:
    """[(prompt + continuation token ids, prompt length), ...] of one shard. A damaged one (an interrupted
    copy or unpacking) is an InputError naming it: removed, the generating command makes it again."""
    try:
        with np.load(path) as z:
            tokens, offsets, lens = z["tokens"], z["offsets"], z["prompt_lens"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise InputError(f"{path}: unreadable corpus shard ({type(e).__name__}: {e}); remove it, and the command "
                         f"that generated the corpus makes it again") from None
    return [(tokens[offsets[i]:offsets[i + 1]].tolist(), int(lens[i])) for i in range(len(lens))]


