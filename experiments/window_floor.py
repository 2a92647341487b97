"""Passkey recall of the original with all but the kept layers cut to a sliding window: the floor (CPU).

A lolcats layer is exact over its last W tokens and leaves everything further back to its feature maps. Take the
feature maps' part away (each converted layer attends to its last ``--window`` tokens and, with ``--sinks N``,
the first N, nothing else) and what is left of a pass key lying further back than W is what the kept softmax
layers recover alone. This prints that floor for each ``--keep`` set of softmax layers: the passkey prompts of
`linearize eval --task passkey` (same builder, seeds and chat template), scored as the conversion's recall check
scores them (every token of the key the argmax after the prompt and the key's earlier tokens, one forward), by
depth. ``all`` keeps every layer (the original), ``none`` windows every layer.

    python experiments/window_floor.py --lengths 8K --window 4096 --depths 0,0.25,0.5 --seeds 4 \\
        --keep none,18+23,21+23,22+23,7+18+22+23,all

The question it answers: which softmax layers a sparse layout (15:1 keeps two of SmolLM2-135M's 30) needs so
that a lookup beyond the window survives, before any training decides it.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from linearize.evals import passkey
from linearize.evals.common import EvalConfig, ModelHandle, tail_logits
from linearize.evals.prompts import PieceEncoder
from linearize.io.sources import load_model
from linearize.units import parse_length

NAME = "window_floor"
#: what the attention function reads: the window, the sinks and the layers kept exact
SETTING = {"window": 4096, "sinks": 0, "keep": frozenset()}
_MASKS: dict = {}


def band_mask(T: int, window: int, sinks: int, device) -> torch.Tensor:
    """``[T, T]`` bool, True where query i sees key j: causal, within the last ``window`` tokens or among the
    first ``sinks``."""
    key = (T, window, sinks, str(device))
    if key not in _MASKS:
        i = torch.arange(T, device=device).view(T, 1)
        j = torch.arange(T, device=device).view(1, T)
        _MASKS.clear()
        _MASKS[key] = (j <= i) & ((i - j < window) | (j < sinks))
    return _MASKS[key]


def windowed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA over ``[B, H, T, D]`` without padding: causal for a kept layer, the band for the others."""
    if attention_mask is not None:  # the masks here are built from positions alone
        raise ValueError("window_floor runs single unpadded sequences (no attention mask)")
    T = query.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if module.layer_idx in SETTING["keep"] or T <= SETTING["window"]:
        o = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    else:
        mask = band_mask(T, SETTING["window"], SETTING["sinks"], query.device)
        o = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return o.transpose(1, 2).contiguous(), None


def parse_keep(value: str, layers: int) -> list[tuple[str, frozenset]]:
    sets = []
    for name in value.split(","):
        if name == "all":
            sets.append((name, frozenset(range(layers))))
        elif name == "none":
            sets.append((name, frozenset()))
        else:
            sets.append((name, frozenset(int(x) for x in name.split("+"))))
    return sets


@torch.no_grad()
def key_found(handle: ModelHandle, ids: list[int], answer: list[int]) -> bool:
    """Every token of the key the argmax after the prompt and the key's earlier tokens (the recall check's rule)."""
    pred = tail_logits(handle, ids + answer, len(answer) + 1)[:-1].argmax(-1).cpu()
    return bool((pred == torch.as_tensor(answer)).all())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="8K")
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--window", type=lambda v: parse_length(v, what="--window"), default=4096)
    ap.add_argument("--sinks", type=int, default=0)
    ap.add_argument("--keep", default="none,all", help="comma-separated sets: all, none or layers joined by +")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype), device="cpu")
    model.eval()
    AttentionInterface.register(NAME, windowed_attention)
    model.set_attn_implementation(NAME)
    SETTING.update(window=args.window, sinks=args.sinks)
    chat = bool(getattr(tok, "chat_template", None))
    enc = PieceEncoder(tok)
    handle = ModelHandle(args.model, "model", model, tok, chat)
    depths = [float(d) for d in args.depths.split(",")]
    lengths = [parse_length(x, what="--lengths") for x in args.lengths.split(",")]
    cfg = EvalConfig(lengths=lengths, depths=depths, seeds=list(range(args.seeds)))
    prompts = passkey.build_prompts(tok, chat, cfg)
    print(f"window {args.window}, sinks {args.sinks}, {args.dtype}; keys found of {args.seeds} prompts per depth "
          f"({', '.join(f'{d:g}' for d in depths)})", flush=True)
    for name, keep in parse_keep(args.keep, model.config.num_hidden_layers):
        SETTING["keep"] = keep
        for L in lengths:
            t0 = time.time()
            hits = {d: 0 for d in depths}
            for p in prompts:
                row = p["row"]
                if row["length"] == L:
                    hits[row["depth"]] += key_found(handle, p["ids"], passkey.answer_ids(enc, row["expected"][0]))
            total = sum(hits.values()) / (len(depths) * args.seeds)
            print(f"keep {name:<14} {L:>6}: {100 * total:5.1f}%  by depth " + " / ".join(str(hits[d]) for d in depths)
                  + f"  ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
