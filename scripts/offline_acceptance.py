"""Offline measurements for the feature drafter, before any training (issue 17, deliverable 1).

Under greedy decoding the tokens a speculative step accepts are exactly the common prefix of a draft
with the LLM's own continuation, so stored greedy continuations answer two questions without
running the LLM:

1. **What lookup drafting alone gives**: replay the lookup drafter's rule (the jitted
   ``find_chains`` of ``specjax.speculation.drafters.lookup``) step by step over each continuation:
   tokens per pass by corpus part / task kind and by (depth, branches).
2. **How well the tree budget chooses** (``--costs``, seconds per pass at each rung of the lookup
   drafter's ladder, e.g. from ``specjax tree-cost``): replay the default drafter and its estimator
   (``propose``, ``expected_accepted``, ``commit``, ``choose_level``: the jitted code itself) and
   price every pass, against an oracle that knows each step's accepted run before choosing (the
   bound on what better acceptance estimates could give) and against every fixed level.
   With ``--answers`` the same replay for the corpus drafter (the lookup rule with a corpus of the
   LLM's own earlier answers as a second source, ``specjax.speculation.drafters.corpus``).
3. **What per-step agreement a drafter needs**: a drafter whose depth-d draft is right with
   probability a (given the draft so far was right) gives E[tokens per pass] = sum_{d=0..D} a^d for a
   chain of depth D; a tree that keeps the top-k at each depth gives sum_d prod_{i<=d} a_k with a_k
   its top-k agreement. Printed: the agreement needed for 2.5 / 3.0 / 3.5 tokens per pass, and, with
   ``--agreement`` (e.g. measured held-out values by depth), the tokens per pass they give, alone and
   merged with lookup (per step the longer accepted run of the two; the drafter's run simulated from
   the agreement profile with a fixed seed).

    python scripts/offline_acceptance.py --corpus /work/data/feature-corpus --parts passages,tasks-greedy
    python scripts/offline_acceptance.py --prompts-file scripts/data/task_kinds.jsonl --max-new-tokens 128
    python scripts/offline_acceptance.py --corpus feature-out/feature-corpus \
        --parts eval-43136b690851/continuations --settings 8x2 --answers auto     # the dev prompts' continuations
    python scripts/offline_acceptance.py --prompts-file scripts/data/grounded_copy.jsonl \
        --costs 0.0248,0.0317,0.0423,0.0493,0.0611
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402


def replay_lookup(sequences, depth: int, branches: int, max_ngram: int = 3, corpus=None) -> list[list[int]]:
    """Accepted tokens + 1 of every greedy step of every (ids, prompt_len), lookup drafter only, or with
    ``corpus`` (the corpus drafter's index params) the corpus drafter's rule at its default n-grams."""
    import jax
    import jax.numpy as jnp

    from specjax.speculation.drafters.corpus import CorpusDrafter, find_in_corpus, pick_chains
    from specjax.speculation.drafters.lookup import find_chains

    if corpus is None:
        find = jax.jit(lambda h, n: find_chains(h, n, depth, branches, max_ngram, 1))
    else:
        c = CorpusDrafter(depth=depth, branches=branches, max_ngram=max_ngram)

        def both(params, h, n):
            own = find_chains(h, n, depth, branches, max_ngram, 1)
            quoted = find_in_corpus(params, h, n, depth, branches, c.corpus_max_ngram, c.corpus_min_ngram, c.window)
            return pick_chains(own, quoted, depth, branches)[:3]

        find = functools.partial(jax.jit(both), corpus)
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


def _accepted_by_node(tokens, parent, ok, truth):
    """Per node of one proposal: its depth if the path from the root to it equals ``truth``, else -1."""
    run = np.full(len(tokens), -1)
    run[0] = 0
    for i in range(1, len(tokens)):
        up = run[parent[i]]
        if ok[i] and up >= 0 and up < len(truth) and tokens[i] == truth[up]:
            run[i] = up + 1
    return run


def _lookup_ladder() -> tuple[int, ...]:
    """The default lookup drafter's budget ladder: nodes below the root at each level."""
    from specjax.speculation.drafters.lookup import LookupDrafter

    return LookupDrafter().budget_ladder()


def _parse_costs(text: str) -> list[float]:
    """argparse type of --costs: one positive number of seconds per level of the default lookup drafter's ladder."""
    ladder = _lookup_ladder()
    try:
        costs = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of seconds: {text!r}") from None
    if len(costs) != len(ladder) or not all(np.isfinite(c) and c > 0 for c in costs):
        raise argparse.ArgumentTypeError(f"need {len(ladder)} positive seconds, one per level of the lookup ladder "
                                         f"{ladder} (nodes below the root), got {text!r}")
    return costs


def _parse_settings(text: str) -> list[tuple[int, int]]:
    """argparse type of --settings: comma-separated DEPTHxBRANCHES, both >= 1 ("8x1,8x2")."""
    settings = []
    for item in text.split(","):
        try:
            depth, branches = (int(x) for x in item.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r} is not DEPTHxBRANCHES (e.g. 8x2)") from None
        if depth < 1 or branches < 1:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r}: depth and branches must be >= 1")
        settings.append((depth, branches))
    return settings


def _parse_agreement(text: str) -> list[float]:
    """argparse type of --agreement: comma-separated probabilities in [0, 1], one per depth."""
    try:
        profile = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of probabilities: {text!r}") from None
    if not all(0.0 <= a <= 1.0 for a in profile):
        raise argparse.ArgumentTypeError(f"every agreement must lie in [0, 1], got {text!r}")
    return profile


def replay_budget(sequences, costs, policy: str) -> list[tuple[int, float]]:
    """Greedy replay of the default lookup drafter under a tree budget with these per-level ``costs``
    (seconds per pass). policy: "budget" (the drafter's own estimates and ``choose_level``, as in the
    loop), "oracle" (the level with the most accepted tokens per second, knowing the truth) or
    "level=<l>" (always level l). Returns per sequence (tokens emitted, modelled seconds, passes)."""
    import jax
    import jax.numpy as jnp

    from specjax.speculation.budget import Budget, choose_level
    from specjax.speculation.drafters.base import Accepted, DraftContext
    from specjax.speculation.drafters.lookup import LookupDrafter
    from specjax.speculation.state import greedy_sampling

    drafter = LookupDrafter()
    ladder = drafter.budget_ladder()
    budget = Budget(tuple((m,) for m in ladder), costs=tuple(float(c) for c in costs))
    size = -(-(max(len(s) for s, _ in sequences) + drafter.depth + 2) // 64) * 64
    history = np.zeros((len(sequences), size), np.int32)
    for i, (ids, _) in enumerate(sequences):
        history[i, :len(ids)] = ids
    end = np.asarray([len(s) - 1 for s, _ in sequences])
    root = np.asarray([p for _, p in sequences])
    batch = len(sequences)

    @jax.jit
    def propose(state, visible, length):
        ctx = DraftContext(history=visible, length=length, sampling=greedy_sampling(batch),
                           max_depth=drafter.max_depth)
        proposal, state = drafter.propose((), state, ctx)
        expected = drafter.expected_accepted((), state, ladder)
        return proposal, state, expected

    commit = jax.jit(lambda state, acc: drafter.commit((), state, acc))
    state = drafter.init((), jnp.asarray(history), jnp.asarray(root), cache_len=size)
    emitted_total = np.zeros(batch, np.int64)
    seconds = np.zeros(batch)
    passes = np.zeros(batch, np.int64)
    width = drafter.max_depth + 1
    while (root < end).any():
        visible = np.where(np.arange(size)[None, :] <= root[:, None], history, -1)
        proposal, state, expected = propose(state, jnp.asarray(visible), jnp.asarray(root))
        tokens, parent, ok = (np.asarray(x) for x in (proposal.tokens, proposal.parent, proposal.ok))
        expected = np.asarray(expected)
        path = np.full((batch, width), -1, np.int32)
        emitted = np.zeros((batch, width), np.int32)
        n_emit = np.zeros(batch, np.int32)
        n_acc = np.zeros(batch, np.int32)
        for i in np.nonzero(root < end)[0]:
            truth = history[i, root[i] + 1:end[i] + 1]
            run = _accepted_by_node(tokens[i], parent[i], ok[i], truth)
            got = [int(run[:1 + m].max()) for m in ladder]  # kept nodes are a prefix of the proposal
            if policy == "budget":
                level = int(choose_level(budget, jnp.asarray(expected[i:i + 1]), jnp.ones(1, bool),
                                         jnp.asarray([len(truth)])))
            elif policy == "oracle":
                level = int(np.argmax([min(g + 1, len(truth)) / c for g, c in zip(got, costs)]))
            else:
                level = int(policy.split("=")[1])
            accepted = got[level]
            node = int(np.nonzero(run[:1 + ladder[level]] == accepted)[0][0])  # the deepest path's end
            chain = [node]
            while parent[i][chain[-1]] >= 0:
                chain.append(int(parent[i][chain[-1]]))
            path[i, :len(chain)] = chain[::-1]
            n_acc[i] = accepted
            n_emit[i] = min(accepted + 1, len(truth))
            emitted[i, :n_emit[i]] = truth[:n_emit[i]]
            seconds[i] += costs[level]
            passes[i] += 1
        emitted_total += n_emit
        root = root + n_emit
        state = commit(state, Accepted(path=jnp.asarray(path), num_accepted=jnp.asarray(n_acc),
                                       emitted=jnp.asarray(emitted), num_emitted=jnp.asarray(n_emit),
                                       length=jnp.asarray(root)))
    return list(zip(emitted_total.tolist(), seconds.tolist(), passes.tolist()))


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


def _corpus_shards(root: str, parts: list[str]) -> dict[str, list[str]]:
    """{part: its shard files}, every part checked before any is read: exits naming a missing corpus, part or
    a part with no shards (whose empty replay would fail much later)."""
    if not os.path.isdir(root):
        sys.exit(f"--corpus: no such directory: {root!r}")
    shards = {}
    for part in parts:
        folder = os.path.join(root, part)
        if not os.path.isdir(folder):
            sys.exit(f"--parts: {part!r} is not a folder of the corpus {root!r}")
        shards[part] = [os.path.join(folder, name) for name in sorted(os.listdir(folder))
                        if name.startswith("shard-") and name.endswith(".npz")]
        if not shards[part]:
            sys.exit(f"--parts: {folder!r} holds no shard-*.npz files")
    return shards


def _sequences_from_corpus(root: str, parts: list[str]):
    from specjax.boost.corpus import read_shard

    out = collections.defaultdict(list)
    for part, paths in _corpus_shards(root, parts).items():
        for path in paths:
            out[part] += read_shard(path)
        if not out[part]:
            sys.exit(f"--parts: the shards of {part!r} in {root!r} hold no sequences")
    return out


def _sequences_from_prompts(path: str, max_new_tokens: int):
    import specjax

    records = common.load_prompts(path, None)  # before the model loads: a bad file fails at once
    model = specjax.load_model("smollm2-135m-instruct", progress=False)
    out = collections.defaultdict(list)
    for r in records:
        ids = specjax.api.encode_prompts(model, [r["prompt"]])[0]
        res = specjax.generate(model, [ids], max_new_tokens=max_new_tokens, mode="incremental")
        out[r.get("kind") or r.get("category") or "prompts"].append((ids + res.token_ids[0], len(ids)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", help="a feature corpus directory (specjax.boost.feature_corpus)")
    ap.add_argument("--parts", default="passages,grounded-greedy,tasks-greedy", help="its greedy parts to replay")
    source.add_argument("--prompts-file", type=common.existing_file,
                        help="or: prompts whose greedy continuations are generated here")
    ap.add_argument("--max-new-tokens", type=common.positive_int, default=128)
    ap.add_argument("--max-sequences", type=common.positive_int, default=400, help="per part (a seeded sample)")
    ap.add_argument("--settings", type=_parse_settings, default="8x1,8x2,16x2,8x4",
                    help="lookup depth x branches to replay")
    ap.add_argument("--agreement", type=_parse_agreement,
                    help="drafter agreement by depth, comma-separated (e.g. held-out values)")
    ladder = ", ".join(map(str, _lookup_ladder()))
    ap.add_argument("--costs", type=_parse_costs,
                    help=f"seconds per LLM pass at each level of the lookup drafter's budget ladder "
                         f"({ladder} nodes below the root): replay the tree budget against an oracle")
    ap.add_argument("--answers", help="also replay the corpus drafter over this corpus (auto = the shipped one "
                                      "for SmolLM2, a shipped name, or a path as --drafter corpus: takes)")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    costs = args.costs  # checked while parsing, before any generation
    common.print_header("offline acceptance: lookup replay and the agreement a drafter needs")
    if args.prompts_file:
        data = _sequences_from_prompts(args.prompts_file, args.max_new_tokens)
    else:
        data = _sequences_from_corpus(args.corpus, args.parts.split(","))
    rng = np.random.default_rng(0)
    for part in data:
        if len(data[part]) > args.max_sequences:
            pick = rng.choice(len(data[part]), args.max_sequences, replace=False)
            data[part] = [data[part][i] for i in sorted(pick)]
    report = {"lookup": {}, "needed": {}}
    settings = args.settings
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
    if args.answers:
        import specjax
        from specjax.speculation.drafters import corpus as corpus_drafter

        llm = specjax.describe_model("smollm2-135m-instruct")
        index = corpus_drafter.from_arg(f"{args.answers},depth={max(d for d, _ in settings)}", llm, load=True,
                                        expansion=None, draft="topk").params
        print(f"\n## the corpus drafter over {args.answers} (greedy replay, whole tree): mean tokens per LLM pass")
        print("| part | sequences | " + " | ".join(f"depth {d} x {b}" for d, b in settings) + " |")
        print("|---|---|" + "---|" * len(settings))
        report["corpus"] = {}
        for part, seqs in data.items():
            row = [float(np.mean([x for s in replay_lookup(seqs, d, b, corpus=index) for x in s])) for d, b in settings]
            report["corpus"][part] = dict(zip([f"{d}x{b}" for d, b in settings], row))
            print(f"| {part} | {len(seqs)} | " + " | ".join(f"{x:.2f}" for x in row) + " |")
    if costs:
        policies = ["budget", "oracle"] + [f"level={i}" for i in range(len(costs))]
        print(f"\n## the tree budget's level choice (costs {','.join(map(str, costs))} s per pass): modelled speed "
              f"over incremental decoding (one token per {costs[0]} s), tokens per pass")
        print("| part | " + " | ".join(policies) + " |")
        print("|---|" + "---|" * len(policies))
        report["budget"] = {}
        for part, seqs in data.items():
            cells = {}
            for policy in policies:
                tokens, secs, passes = np.sum(replay_budget(seqs, costs, policy), axis=0)
                cells[policy] = {"speedup": float(tokens / secs * costs[0]), "tokens_per_pass": float(tokens / passes)}
            report["budget"][part] = cells
            print(f"| {part} | " + " | ".join(f"{c['speedup']:.2f}x ({c['tokens_per_pass']:.2f})"
                                               for c in cells.values()) + " |")
    print("\n## per-depth agreement a chain drafter needs (E[tokens/pass] = sum_d a^d)")
    print("| depth | 2.5 | 3.0 | 3.5 | 4.0 |")
    print("|---|---|---|---|---|")
    for depth in (4, 5, 6, 8, 10):
        need = [needed_agreement(t, depth) for t in (2.5, 3.0, 3.5, 4.0)]
        report["needed"][depth] = need
        print(f"| {depth} | " + " | ".join("-" if a is None else f"{a:.3f}" for a in need) + " |")
    if args.agreement:
        profile = args.agreement
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
