"""Benchmark: the corpus drafter (lookup from a user-given corpus) on recurring requests, side by side.

A deployment that answers recurring requests (support questions, the same document summarised again,
code asked for in other words) can keep its earlier answers as a corpus. Three settings, batch 1,
greedy, float32, chat template, every configuration on every prompt in one run, alternating per
prompt (this machine's speed drifts within minutes):

* ``repeat``: each prompt of ``--prompts-file`` again; the corpus holds the LLM's answers to all of
  them (this exact request was answered before);
* ``paraphrase``: the prompts of ``--paraphrases-file``, each naming its ``original`` in
  ``--prompts-file``; the corpus holds the answers to the originals (asked before in other words);
* ``others``: each prompt of ``--prompts-file``; the corpus holds the answers to every *other* prompt
  (nothing answered before: what the corpus costs when it does not help).

The answers are the LLM's own greedy outputs (specjax incremental, ``--max-new-tokens``), stored as
token ids. Configurations: specjax incremental, ``lookup + budget`` (the lookup drafter alone under the
tree budget: not specjax's default, which for SmolLM2 merges the feature drafter with lookup) and
the corpus drafter (lookup with the corpus as a second source, ``corpus:PATH`` + tree budget). Every
corpus has the same capacity, so one compiled loop serves them all; time excludes compilation.
Every output is compared with incremental decoding's (greedy: must be identical).

    python scripts/bench_corpus.py --json bench_out/corpus.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402

HERE = os.path.join(os.path.dirname(__file__), "data")
LOOKUP = "lookup + budget"  # the lookup drafter alone; the corpus drafter is lookup plus the corpus
CONFIGS = ("incremental", LOOKUP, "corpus")
SETTINGS = ("repeat", "paraphrase", "others")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts-file", type=common.existing_file, default=os.path.join(HERE, "task_kinds.jsonl"))
    ap.add_argument("--paraphrases-file", type=common.existing_file,
                    default=os.path.join(HERE, "corpus_paraphrases.jsonl"))
    ap.add_argument("--max-new-tokens", type=common.positive_int, default=128)
    ap.add_argument("--settings", type=common.name_list(SETTINGS), default=list(SETTINGS),
                    help=f"comma-separated, from {', '.join(SETTINGS)}")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    settings = args.settings

    import specjax
    from specjax.speculation.drafters.corpus import corpus_drafter
    from specjax.speculation.drafters.lookup import LookupDrafter

    common.print_header("corpus drafter on recurring requests (batch 1, greedy, float32)")
    recs = common.load_prompts(args.prompts_file, None)  # read and checked before the model loads
    ids = {r["id"]: r for r in recs}
    paras = common.load_prompts(args.paraphrases_file, None) if "paraphrase" in settings else []
    missing = [p["id"] for p in paras if p.get("original") not in ids]
    if missing:
        sys.exit(f"{args.paraphrases_file}: {missing} name no 'original' id of {args.prompts_file}")
    llm = specjax.load_model(args.model, progress=False)
    encode = lambda rs: specjax.api.encode_prompts(llm, [r["prompt"] for r in rs])  # noqa: E731
    prompts, para_prompts = encode(recs), encode(paras)

    def run(config, prompt, corpus_docs=None, capacity=None):
        kw = dict(max_new_tokens=args.max_new_tokens)
        if config == "incremental":
            return specjax.generate(llm, [prompt], mode="incremental", **kw)
        drafter = specjax.Bound(LookupDrafter()) if config == LOOKUP else corpus_drafter(
            llm, corpus_docs, capacity=capacity)
        return specjax.generate(llm, [prompt], drafters=[drafter], budget="auto", **kw)

    print("# answers: the LLM's greedy outputs (specjax incremental) ...", flush=True)
    answers = {r["id"]: run("incremental", p).token_ids[0] for r, p in zip(recs, prompts)}
    capacity = sum(len(a) + 1 for a in answers.values())
    cases = []  # (setting, kind, prompt, corpus documents)
    for r, p in zip(recs, prompts):
        if "repeat" in settings:
            cases.append(("repeat", r["category"], p, list(answers.values())))
        if "others" in settings:
            cases.append(("others", r["category"], p, [a for k, a in answers.items() if k != r["id"]]))
    for r, p in zip(paras, para_prompts):
        cases.append(("paraphrase", r["category"], p, [answers[r["original"]]] +
                      [a for k, a in answers.items() if k != r["original"]]))
    print(f"# corpus capacity {capacity} tokens; {len(cases)} prompts in {len(settings)} settings; warming up ...",
          flush=True)
    for c in CONFIGS:  # compile every configuration once
        run(c, cases[0][2], cases[0][3], capacity)

    totals = collections.defaultdict(lambda: [0.0, 0, 0])  # (setting, config) -> seconds, tokens, passes
    by_kind = collections.defaultdict(lambda: [0.0, 0])
    for i, (setting, kind, prompt, docs) in enumerate(cases):
        order = CONFIGS[i % len(CONFIGS):] + CONFIGS[:i % len(CONFIGS)]
        outs = {}
        for c in order:
            res = run(c, prompt, docs, capacity)
            outs[c] = res.token_ids[0]
            t = totals[(setting, c)]
            t[0] += res.stats["seconds"]
            t[1] += len(res.token_ids[0])
            t[2] += res.stats["llm_passes"]
            k = by_kind[(setting, kind, c)]
            k[0] += res.stats["seconds"]
            k[1] += len(res.token_ids[0])
        diff = [c for c in CONFIGS if outs[c] != outs["incremental"]]
        if diff:
            sys.exit(f"case {i} ({setting}, {kind}): {diff} differ from incremental decoding")

    results = {"machine": common.machine(), "command": common.command(), "max_new_tokens": args.max_new_tokens,
               "capacity": capacity, "settings": {}}
    print("\n| setting | prompts | " + " | ".join(f"{c} tok/s (tok/pass)" for c in CONFIGS)
          + " | corpus / lookup |")
    print("|---" * (len(CONFIGS) + 3) + "|")
    for setting in settings:
        n = sum(1 for c in cases if c[0] == setting)
        rates = {c: totals[(setting, c)][1] / totals[(setting, c)][0] for c in CONFIGS}
        per_pass = {c: (totals[(setting, c)][1] - n) / max(totals[(setting, c)][2] - n, 1) for c in CONFIGS}
        cells = " | ".join(f"{rates[c]:.2f} ({per_pass[c]:.2f})" for c in CONFIGS)
        print(f"| {setting} | {n} | {cells} | {rates['corpus'] / rates[LOOKUP]:.2f}x |")
        kinds = sorted({k for (s, k, _) in by_kind if s == setting})
        results["settings"][setting] = {
            "prompts": n, "tokens_per_second": rates, "tokens_per_pass": per_pass,
            "by_kind": {k: {c: by_kind[(setting, k, c)][1] / by_kind[(setting, k, c)][0] for c in CONFIGS}
                        for k in kinds}}
    for setting in settings:
        print(f"\n{setting}, tokens/s by kind:")
        for k, row in results["settings"][setting]["by_kind"].items():
            print(f"  {k:14s} " + "  ".join(f"{c} {row[c]:6.2f}" for c in CONFIGS))
    print("\nAll outputs identical to incremental decoding.")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
