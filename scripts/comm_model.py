"""Communication per LLM pass of tree verification under TP x PP (the model in docs/scale_out.md).

Counts the bytes each collective moves for one LLM forward pass over a batch of B requests with a
token tree of N nodes each (N = 1 is incremental decoding), and the pipeline bubble, for a given
model and mesh. Defaults: LLaMA-65B on 2 nodes x 4 GPUs (TP = 4 inside a node, PP = 2 across).

    python scripts/comm_model.py --batch 16 --nodes 64 --microbatches 2
"""

from __future__ import annotations

import argparse

MODELS = {  # layers, width, heads, kv heads, MLP hidden, vocabulary
    "llama-65b": (80, 8192, 64, 64, 22016, 32000),
    "llama-7b": (32, 4096, 32, 32, 11008, 32000),
    "smollm2-135m": (30, 576, 9, 3, 1536, 49152),
}


def per_pass(layers, width, vocab, batch, nodes, tp, pp, microbatches, act_bytes=2, logit_bytes=4):
    """Bytes moved by one LLM pass as specjax runs it (see docs/scale_out.md for the schedule)."""
    tokens = batch * nodes
    act = tokens * width * act_bytes  # one activation tensor [B * N, D]
    ticks = microbatches + pp - 1 if pp > 1 else 1
    groups = microbatches if pp > 1 else 1
    ring = 2 * (tp - 1) / tp  # bytes a ring all-reduce sends per device, per byte of payload
    # Megatron TP: attention out-projection and MLP down-projection end in an all-reduce, on every
    # tick (bubble ticks compute too) over one request group; the vocab-parallel embedding adds one.
    tp_payload = 2 * (layers // pp) * ticks * act / groups + act
    inter = 0.0
    if pp > 1:
        # every tick each stage ppermutes one group's activations (A / M) to the next stage; they are
        # replicated over tp, so each of the T tensor shards sends its copy to its peer
        inter = tp * (pp - 1) * ticks * act / groups
        # the last stage's output goes to every stage with one psum over pp (again once per tp shard)
        inter += tp * act * 2 * (pp - 1) / pp
    return {
        "tp_allreduces_per_stage": 2 * (layers // pp) * ticks + 1,
        "tp_allreduce_payload_per_stage": tp_payload,
        "tp_bytes_sent_per_gpu": tp_payload * ring,
        # vocab-parallel LM head: the verifier needs whole rows of logits, so each stage (all of them
        # compute the head after the psum) all-gathers [B * N, V] float32 over tp inside its node
        "logits_allgather_bytes": tokens * vocab * logit_bytes * (tp - 1) / tp,
        "ppermute_bytes_per_tick": act / groups,
        "inter_node_bytes_per_pass": inter,
        "ticks": ticks,
        "bubble_fraction": (pp - 1) / ticks if pp > 1 else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-65b", choices=sorted(MODELS))
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--intra-gbps", type=float, default=300.0, help="NVLink GB/s per GPU per direction")
    ap.add_argument("--inter-gbps", type=float, default=12.5, help="node-to-node GB/s (100 Gb/s)")
    args = ap.parse_args()
    layers, width, heads, kv, mlp, vocab = MODELS[args.model]
    print(f"# {args.model}: {layers} layers, width {width}, vocab {vocab}; TP={args.tp} x PP={args.pp}, "
          f"{args.microbatches} microbatches; bf16 activations, float32 logits; "
          f"links {args.intra_gbps:g} GB/s (in node), {args.inter_gbps:g} GB/s (across nodes)")
    print(f"{'B':>4} {'N':>4} {'TP all-reduces':>14} {'TP payload/stage':>17} {'TP sent/GPU':>12} "
          f"{'logits gather':>14} {'ppermute/tick':>14} {'across nodes':>13} {'TP ms':>7} {'PP ms':>7} {'bubble':>7}")
    for b in args.batch:
        for n in args.nodes:
            c = per_pass(layers, width, vocab, b, n, args.tp, args.pp, min(args.microbatches, b))
            tp_ms = (c["tp_bytes_sent_per_gpu"] + c["logits_allgather_bytes"]) / (args.intra_gbps * 1e6)
            pp_ms = c["inter_node_bytes_per_pass"] / (args.inter_gbps * 1e6)
            mib = lambda x: f"{x / 2**20:.2f} MiB"  # noqa: E731
            print(f"{b:>4} {n:>4} {c['tp_allreduces_per_stage']:>14} {mib(c['tp_allreduce_payload_per_stage']):>17} "
                  f"{mib(c['tp_bytes_sent_per_gpu']):>12} {mib(c['logits_allgather_bytes']):>14} "
                  f"{mib(c['ppermute_bytes_per_tick']):>14} {mib(c['inter_node_bytes_per_pass']):>13} "
                  f"{tp_ms:7.2f} {pp_ms:7.2f} {c['bubble_fraction']:7.2f}")


if __name__ == "__main__":
    main()
