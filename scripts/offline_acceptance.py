"""Offline measurements for the feature drafter, before any training (issue 17, deliverable 1).

Under greedy decoding the tokens a speculative step accepts are exactly the common prefix of a draft
with the LLM's own continuation, so stored greedy continuations answer two questions without
running the LLM:

1. **What lookup drafting alone gives**: replay the lookup drafter's rule (the jitted
   ``find_chains`` of ``specjax.speculation.drafters.lookup``) step by step over each continuation:
   tokens per pass by corpus part / task kind and by (depth, branches).
2. **What per-step agreement a drafter needs**: a drafter whose depth-d draft is right with
   probability a (given the draft so far was right) gives E[tokens per pass] = sum_{d=0..D} a^d for a
   chain of depth D; a tree that keeps the top-k at each depth gives sum_d prod_{i<=d} a_k with a_k
   its top-k agreement. Printed: the agreement needed for 2.5 / 3.0 / 3.5 tokens per pass, and, with
   ``--agreement`` (e.g. measured held-out values by depth), the tokens per pass they give, alone and
   merged with lookup (per step the longer accepted run of the two; the drafter's run simulated from
   the agreement profile with a fixed seed).

    python scripts/offline_acceptance.py --corpus /work/data/feature-corpus --parts passages,tasks-greedy
    python scripts/offline_acceptance.py --prompts-file scripts/data/task_kinds.jsonl --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402


def replay_lookup(sequences, depth: int, branches: int, max_ngram: int = 3) -> list[list[int]]:
    """Accepted tokens + 1 of every greedy step of every (ids, prompt_len), lookup drafter only."""
    import jax
    import jax.numpy as jnp

    from specjax.speculation.drafters.lookup import find_chains

    find = jax.jit(lambda h, n: find_chains(h, n, depth, branches, max_ngram, 1))
    size = max(len(s) for s, _ in sequences) + depth + 2
    size = -(-size // 64) * 64
    history = np.zeros((len(sequences), size), np.int32)
    for i, (ids, _) in enumerate(sequences):
        history[i, :len(ids)] = ids
    end = np.asarray([len(s) - 1 for s, _ in sequences])
    root = np.asarray([p for _, p in sequences])  # the first generated token is the first root
    steps = [[] for _ in sequences]
    while (root < end).any():
        # the drafter sees committed tokens only: mask everything past each root
        visible = np.where(np.arange(size)[None, :] <= root[:, None], history, -1)
        chains, known, _ = (np.asarray(x) for x in find(jnp.asarray(visible), jnp.asarray(root)))
        for i in np.nonzero(root < end)[0]:
            truth = history[i, root[i] + 1:end[i] + 1]
            best = 0
            for c in range(branches):
                n = min(int(known[i, c]), len(truth))
                same = chains[i, c, :n] == truth[:n]
                best = max(best, int(np.cumprod(same).sum()))
            emitted = min(best + 1, len(truth))
            steps[i].append(emitted)
            root[i] += emitted
    return steps


def chain_tokens(a: float, depth: int) -> float:
    return sum(a ** d for d in range(depth + 1))


def needed_agreement(target: float, depth: int) -> float | None:
    lo, hi = 0.0, 1.0
    if chain_tokens(1.0, depth) < target:
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_tokens(mid, depth) < target else (lo, mid)
    return hi


def simulate_merged(lookup_steps, profile, depth: int, seed: int = 0):
    """Tokens per pass of the drafter (agreement ``profile`` by depth) alone and merged with lookup, on
    the same continuations: per step the drafter's run is its first miss, drawn with the profile."""
    rng = np.random.default_rng(seed)
    alone, merged = [], []
    for steps in lookup_steps:
        for emitted in steps:
            run = 0
            while run < min(depth, len(profile)) and rng.random() < profile[run]:
                run += 1
            alone.append(run + 1)
            merged.append(max(run + 1, emitted))
    return float(np.mean(alone)), float(np.mean(merged))


def _sequences_from_corpus(root: str, parts: list[str]):
    from specjax.boost.corpus import read_shard

    out = collections.defaultdict(list)
    for part in parts:
        folder = os.path.join(root, part)
        for name in sorted(os.listdir(folder)):
            if name.startswith("shard-") and name.endswith(".npz"):
                out[part] += read_shard(os.path.join(folder, name))
    return out


def _sequences_from_prompts(path: str, max_new_tokens: int):
    import specjax

    model = specjax.load_model("smollm2-135m-instruct", progress=False)
    records = common.load_prompts(path, None)
    out = collections.defaultdict(list)
    for r in records:
        ids = specjax.api.encode_prompts(model, [r["prompt"]])[0]
        res = specjax.generate(model, [ids], max_new_tokens=max_new_tokens)
        out[r.get("kind") or r.get("category") or "prompts"].append((ids + res.token_ids[0], len(ids)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", help="a feature corpus directory (specjax.boost.feature_corpus)")
    ap.add_argument("--parts", default="passages,grounded-greedy,tasks-greedy", help="its greedy parts to replay")
    ap.add_argument("--prompts-file", help="or: prompts whose greedy continuations are generated here")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-sequences", type=int, default=400, help="per part (a seeded sample)")
    ap.add_argument("--settings", default="8x1,8x2,16x2,8x4", help="lookup depth x branches to replay")
    ap.add_argument("--agreement", help="drafter agreement by depth, comma-separated (e.g. held-out values)")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    common.print_header("offline acceptance: lookup replay and the agreement a drafter needs")
    if args.prompts_file:
        data = _sequences_from_prompts(args.prompts_file, args.max_new_tokens)
    elif args.corpus:
        data = _sequences_from_corpus(args.corpus, args.parts.split(","))
    else:
        sys.exit("give --corpus or --prompts-file")
    rng = np.random.default_rng(0)
    for part in data:
        if len(data[part]) > args.max_sequences:
            pick = rng.choice(len(data[part]), args.max_sequences, replace=False)
            data[part] = [data[part][i] for i in sorted(pick)]
    report = {"lookup": {}, "needed": {}}
    settings = [tuple(int(x) for x in s.split("x")) for s in args.settings.split(",")]
    print("\n## lookup drafting alone (greedy replay): mean tokens per LLM pass")
    print("| part | sequences | " + " | ".join(f"depth {d} x {b}" for d, b in settings) + " |")
    print("|---|---|" + "---|" * len(settings))
    replays = {}
    for part, seqs in data.items():
        row = []
        for d, b in settings:
            steps = replay_lookup(seqs, d, b)
            replays[(part, d, b)] = steps
            row.append(float(np.mean([x for s in steps for x in s])))
        report["lookup"][part] = dict(zip([f"{d}x{b}" for d, b in settings], row))
        print(f"| {part} | {len(seqs)} | " + " | ".join(f"{x:.2f}" for x in row) + " |")
    print("\n## per-depth agreement a chain drafter needs (E[tokens/pass] = sum_d a^d)")
    print("| depth | 2.5 | 3.0 | 3.5 | 4.0 |")
    print("|---|---|---|---|---|")
    for depth in (4, 5, 6, 8, 10):
        need = [needed_agreement(t, depth) for t in (2.5, 3.0, 3.5, 4.0)]
        report["needed"][depth] = need
        print(f"| {depth} | " + " | ".join("-" if a is None else f"{a:.3f}" for a in need) + " |")
    if args.agreement:
        profile = [float(x) for x in args.agreement.split(",")]
        d0, b0 = settings[0]
        print(f"\n## a drafter with agreement {profile} by depth, alone and merged with lookup {d0}x{b0}")
        report["drafter"] = {}
        for part in data:
            alone, merged = simulate_merged(replays[(part, d0, b0)], profile, len(profile))
            report["drafter"][part] = {"alone": alone, "merged": merged}
            print(f"{part}: alone {alone:.2f}, merged {merged:.2f} tokens per pass")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
