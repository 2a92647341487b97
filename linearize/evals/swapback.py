"""Which linear layer does a hybrid's recall miss? Passkey key accuracy with each linear layer switched back to
its original softmax attention, one at a time.

The prompts are ``passkey``'s (same lengths, depths and seeds). Each one is scored teacher-forced: it counts
when the model's top token at every position of " KEY" after the prompt is that token (no generation, so a layer
in softmax mode needs no cache); ``key_nll`` is the key's mean negative log-likelihood (nats/token), which moves
even where no prompt flips. A hybrid is scored as it is (``score``, ``by_length``), then once per linear
layer with that layer alone running the original softmax attention from its own (possibly LoRA-merged)
projections (``layers``). A layer whose swap lifts the score is one the hybrid needs as softmax: keep it with
``--softmax-layers`` (or let ``--select auto``'s swap check find such a layer). A model without linear layers
(the original, with ``--against``) is scored as it is only. Cost: (linear layers + 1) forward passes per prompt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import passkey
from .common import EvalConfig, ModelHandle, Progress, grid_summary, no_args, tail_logits
from .prompts import PieceEncoder

NAME = "swapback"
#: layers listed in ``best``: the largest gains
BEST = 5


def parse_args(arg: str | None) -> dict:
    return no_args(NAME, arg)


def count(cfg: EvalConfig, args: dict) -> int:
    return passkey.count(cfg, args)  # progress advances by 1 / layouts per prompt and layout


def score_key(handle: ModelHandle, prompt: list[int], answer: list[int]) -> tuple[bool, float]:
    """Teacher-forced: (the top token at every answer position is the answer's token, the answer's mean negative
    log-likelihood in nats/token)."""
    logits = tail_logits(handle, prompt + answer, len(answer) + 1)[:-1].cpu()  # [n, vocab]: those predicting the answer
    target = torch.tensor(answer)
    return bool((logits.argmax(-1) == target).all()), F.cross_entropy(logits, target).item()


def run(handle: ModelHandle, cfg: EvalConfig, args: dict, progress: Progress, shared: dict) -> list[dict]:
    samples = passkey.build_prompts(handle.tokenizer, handle.chat, cfg, args)
    enc = PieceEncoder(handle.tokenizer)
    model = handle.model
    linear = model.linear_modules() if hasattr(model, "linear_modules") else []
    layouts = [None] + [m.layer_idx for m in linear]  # None: the model as it is
    before = [m.mode for m in linear]
    rows = []
    try:
        for layer in layouts:
            if linear:
                model.set_softmax_layers(set() if layer is None else {layer})
            for s in samples:
                ok, nll = score_key(handle, s["ids"], enc.encode_one(" " + s["row"]["expected"][0]))
                rows.append({**s["row"], "task": NAME, "layer": layer, "score": float(ok), "strict": float(ok),
                             "key_nll": round(nll, 6)})
                progress.advance(1 / len(layouts))
    finally:
        for m, mode in zip(linear, before):
            m.mode = mode
    return rows


def summarize(rows: list[dict], cfg: EvalConfig) -> dict:
    """The model as it is (``score``, ``by_length``, ``n``, ``key_nll``) plus ``layers`` (per swapped layer: score,
    by_length, key_nll) and ``best`` (the :data:`BEST` swapped layers with the highest scores, then lowest key NLL)."""

    def part(sel: list[dict]) -> dict:
        out = grid_summary(sel, cfg, with_grid=False)
        out["key_nll"] = round(sum(r["key_nll"] for r in sel) / max(1, len(sel)), 6)
        return out

    out = part([r for r in rows if r["layer"] is None])
    layers = sorted({r["layer"] for r in rows if r["layer"] is not None})
    out["layers"] = {str(i): part([r for r in rows if r["layer"] == i]) for i in layers}
    for v in out["layers"].values():
        del v["metric"], v["higher_is_better"], v["strict"]
    # the largest accuracy gains; ties (e.g. no prompt flips) go to the lower key NLL
    order = sorted(out["layers"], key=lambda i: (-out["layers"][i]["score"], out["layers"][i]["key_nll"], int(i)))
    out["best"] = [{"layer": int(i), "score": out["layers"][i]["score"], "key_nll": out["layers"][i]["key_nll"],
                    "gain": round(out["layers"][i]["score"] - out["score"], 6)} for i in order[:BEST]]
    return out
