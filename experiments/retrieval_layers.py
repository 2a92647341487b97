"""Which layers of the original model retrieve the pass key, by prompt length and needle depth (CPU, a minute).

For each passkey prompt of `linearize eval --task passkey` (the same builder, chat template and seeds), the
original SmolLM2-135M reads the prompt once and each layer's softmax attention from the last prompt position onto
the tokens that spell the key is summed (the largest over the layer's heads, averaged over seeds): the measure
the `--select auto` probe weighs as `select.attention_weight`, here split by depth. Printed per (length, depth):
the needle's token position and the layers holding the most weight on the key.

    python experiments/retrieval_layers.py --lengths 1K,2K,8K --depths 0,0.25,0.5 --seeds 2
"""
from __future__ import annotations

import argparse

import torch

from linearize import recipe as recipes
from linearize.convert import probe
from linearize.evals import passkey
from linearize.evals.common import EvalConfig
from linearize.io.sources import load_model
from linearize.units import parse_length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="1K,2K,8K")
    ap.add_argument("--depths", default="0,0.25,0.5")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--top", type=int, default=6, help="layers printed per row")
    args = ap.parse_args()
    model, tok = load_model(args.model, dtype=torch.float32, device="cpu")
    chat = bool(getattr(tok, "chat_template", None))
    with probe.all_linear(model, recipes.load("lolcats")) as hybrid:  # run in softmax mode: the original's attention
        print("length  depth  needle at  layers by weight on the key (layer:weight)")
        for length in [parse_length(x, what="--lengths") for x in args.lengths.split(",")]:
            for depth in [float(x) for x in args.depths.split(",")]:
                cfg = EvalConfig(lengths=[length], depths=[depth], seeds=list(range(args.seeds)))
                prompts = passkey.build_prompts(tok, chat, cfg)
                weight = probe.retrieval_attention(hybrid, probe.passkey_triples(tok, prompts))
                top = sorted(range(len(weight)), key=lambda i: -weight[i])[:args.top]
                print(f"{length:>6}  {depth:>5}  {prompts[0]['row']['needle_pos']:>9}  "
                      + " ".join(f"{i}:{weight[i]:.2f}" for i in top), flush=True)


if __name__ == "__main__":
    main()
