"""How much of the original's attention reaches past a sliding window, on held-out text and on passkey prompts (CPU).

A lolcats layer computes exactly only the last W tokens (and the sinks); the rest of each query's attention is the
feature maps' job. For each layer of the original SmolLM2-135M this prints the share of softmax weight that the
last `--queries` positions of a prompt put on keys more than W tokens back (sinks excluded: they stay exact), as
the mean over heads and prompts, for held-out `wiki` text (the training domain) and for the passkey prompts of
`linearize eval --task passkey` (a filler sentence repeated around a 5-digit key). A large share on the passkey
filler that the training text never asks for is what a feature map fitted on wiki rows must extrapolate to.

    python experiments/far_attention.py --lengths 2K,4K --windows 64,512 --sinks 16
"""
from __future__ import annotations

import argparse

import torch

from linearize import recipe as recipes
from linearize.convert import probe
from linearize.evals import passkey
from linearize.evals.common import EvalConfig
from linearize.evals.corpus import heldout_stream
from linearize.io.sources import load_model
from linearize.units import parse_length


def far_shares(hybrid, rows: list[list[int]], windows: list[int], sinks: int, queries: int) -> dict[int, list[float]]:
    """Per window: per layer, the mean share of attention from the last ``queries`` positions onto keys more than
    W tokens back that are not among the first ``sinks`` tokens."""
    mods = hybrid.linear_modules()
    total = {w: [0.0] * len(mods) for w in windows}

    def hook(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        q, k, _ = module.project(hidden, kwargs.get("position_embeddings"))  # [1, T, H, D], [1, T, Hk, D]
        T = k.shape[1]
        n = min(queries, T)
        logits = module.teacher_logits(q[:, -n:], k)  # [1, H, n, T]
        qpos = torch.arange(T - n, T)[:, None]
        kpos = torch.arange(T)[None, :]
        p = logits.masked_fill(kpos > qpos, float("-inf")).softmax(-1)  # causal
        for w in windows:
            far = (kpos <= qpos - w) & (kpos >= sinks)  # [n, T]
            total[w][module.layer_idx] += (p * far).sum(-1).mean().item()

    hybrid.set_attention_mode("softmax")
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in mods]
    try:
        with torch.no_grad():
            for row in rows:
                hybrid(input_ids=torch.tensor([row]), use_cache=False, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return {w: [t / len(rows) for t in v] for w, v in total.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="2K,4K")
    ap.add_argument("--windows", default="64,512")
    ap.add_argument("--sinks", type=int, default=16)
    ap.add_argument("--queries", type=int, default=256, help="last positions of each prompt that are measured")
    ap.add_argument("--prompts", type=int, default=4, help="prompts (or held-out rows) per length")
    ap.add_argument("--layers", default="7,17,18,20,21,22,23", help="softmax layers, marked with * in the table")
    args = ap.parse_args()
    windows = [int(w) for w in args.windows.split(",")]
    kept = {int(i) for i in args.layers.split(",") if i}
    model, tok = load_model(args.model, dtype=torch.float32, device="cpu")
    chat = bool(getattr(tok, "chat_template", None))
    with probe.all_linear(model, recipes.load("lolcats")) as hybrid:
        for length in [parse_length(x, what="--lengths") for x in args.lengths.split(",")]:
            stream = heldout_stream(tok, "wiki", length * args.prompts)
            wiki = [stream[i * length:(i + 1) * length].tolist() for i in range(args.prompts)]
            cfg = EvalConfig(lengths=[length], depths=[0.5], seeds=list(range(args.prompts)))
            keys = [p["ids"] for p in passkey.build_prompts(tok, chat, cfg)]
            res = {"wiki": far_shares(hybrid, wiki, windows, args.sinks, args.queries),
                   "passkey": far_shares(hybrid, keys, windows, args.sinks, args.queries)}
            n = len(res["wiki"][windows[0]])
            print(f"\n{length} tokens: share of attention more than W tokens back (sinks excluded), last "
                  f"{args.queries} positions, {args.prompts} prompts")
            print("layer  " + "  ".join(f"wiki W={w:<4} passkey W={w:<4}" for w in windows))
            for i in range(n):
                print(f"{i:>3}{'*' if i in kept else ' '}   " + "  ".join(
                    f"{res['wiki'][w][i]:>10.3f} {res['passkey'][w][i]:>14.3f}" for w in windows))
            for label, idx in (("linear layers", [i for i in range(n) if i not in kept]), ("all", range(n))):
                idx = list(idx)
                print(f"mean, {label}: " + "  ".join(
                    f"W={w}: wiki {sum(res['wiki'][w][i] for i in idx) / len(idx):.3f}, passkey "
                    f"{sum(res['passkey'][w][i] for i in idx) / len(idx):.3f}" for w in windows))


if __name__ == "__main__":
    main()
