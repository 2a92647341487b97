"""Long-range exact copying on held-out text: can the model repeat a span it saw far back?

A sample is ``L`` tokens of held-out text (the embedded corpus' held-out split, or ``data``)
whose last ``N`` tokens are replaced by an exact copy of the ``N`` tokens that start at the
requested depth of the text before them (depth 0: the start of the sequence, the farthest
copy; depth 1: just before the copy). Teacher-forced, one forward pass per sample: the first
``CUE`` copied tokens identify the span (no model can predict them), and every later copied
token counts as recalled when it is the model's argmax prediction. This is the skill behind
passkey and needle retrieval (find the earlier occurrence of the context, continue it) with no
prompt format to learn and on natural text, so it gives a smooth recall signal where passkey
gives 0/1 answers (SmolLM2-135M itself: 83.5% of tokens at 512-2K tokens, nearly flat in
distance; README, Measured).

Task argument: ``copy:64`` sets ``N`` (default 32, at least ``CUE + 1``). Summary like passkey:
``score`` = mean fraction of recalled tokens, ``strict`` = share of samples with every token
recalled, ``by_length``, ``by_depth``, and the length x depth ``grid``.
"""

from __future__ import annotations

import torch

from linearize.units import UnitError, parse_length

from .common import (EvalConfig, EvalError, ModelHandle, Progress, eval_mode, grid_summary, prompt_sha1, sample_rng,
                     tail_logits)
from .corpus import heldout_stream

NAME = "copy"
DEFAULT_SPAN = 32
#: copied tokens that only identify the span (not scored)
CUE = 4
#: held-out tokens drawn from (sequences are windows of this stream at seeded offsets)
POOL_TOKENS = 65536


def parse_args(arg: str | None) -> dict:
    if not arg:
        return {"span": DEFAULT_SPAN}
    try:
        n = parse_length(arg, what="copy span length")
    except UnitError:
        raise EvalError(f"bad task 'copy:{arg}': expected a span length in tokens like copy:32") from None
    if n <= CUE:
        raise EvalError(f"bad task 'copy:{arg}': the span must be longer than its {CUE}-token cue")
    return {"span": n}


def count(cfg: EvalConfig, args: dict) -> int:
    return len(cfg.lengths) * len(cfg.depths) * len(cfg.seeds)


def build_samples(stream: torch.Tensor, cfg: EvalConfig, span: int) -> list[dict]:
    """Samples for every (length, depth, seed): ``ids`` (a list) and the row describing it."""
    out = []
    n = stream.numel()
    for L in cfg.lengths:
        if L < 2 * span + 1:
            raise EvalError(f"copy: length {L} is too short for a {span}-token span (needs at least {2 * span + 1})")
        for d in cfg.depths:
            for s in cfg.seeds:
                rng = sample_rng(NAME, s, L, d, span)
                begin = rng.randrange(0, max(1, n - L + 1))
                ids = stream[begin:begin + L].tolist()
                src = round(d * (L - 2 * span))  # the source span fits before the copy, depth 0..1
                ids[L - span:] = ids[src:src + span]
                out.append({"ids": ids, "row": {
                    "task": NAME, "seed": s, "length": L, "depth": d, "span": span, "source_pos": src,
                    "distance": L - span - src, "offset": begin, "prompt_tokens": L, "prompt_sha1": prompt_sha1(ids),
                }})
    return out


@torch.no_grad()
def score_sample(handle: ModelHandle, ids: list[int], span: int) -> tuple[float, float]:
    """(share of the scored copied tokens predicted exactly, 1.0 if all were else 0.0)."""
    scored = span - CUE
    logits = tail_logits(handle, ids, scored + 1)[:-1]  # predictions of the last `scored` tokens
    pred = logits.argmax(-1).cpu()
    target = torch.as_tensor(ids[-scored:])
    hits = (pred == target).float()
    return float(hits.mean()), float(hits.min())


def run(handle: ModelHandle, cfg: EvalConfig, args: dict, progress: Progress, shared: dict) -> list[dict]:
    span = args["span"]
    limit = handle.max_positions
    stream = heldout_stream(handle.tokenizer, cfg.data, max(POOL_TOKENS, 2 * max(cfg.lengths)),
                            at_least=max(cfg.lengths))
    rows = []
    for sample in build_samples(stream, cfg, span):
        L = sample["row"]["length"]
        if limit and L > limit:
            rows.append({**sample["row"], "skipped": f"{L} tokens exceed the model's {limit}-token limit",
                         "score": None, "strict": None})
        else:
            score, strict = score_sample(handle, sample["ids"], span)
            rows.append({**sample["row"], "score": round(score, 6), "strict": strict})
        progress.advance()
    return rows


def summarize(rows: list[dict], cfg: EvalConfig) -> dict:
    done = [r for r in rows if r.get("score") is not None]
    out = grid_summary(done, cfg)
    out["span"] = rows[0]["span"] if rows else DEFAULT_SPAN
    out["skipped"] = sorted({r["length"] for r in rows if r.get("skipped")})
    return out


@torch.no_grad()
def quick_check(model, tokenizer, *, length: int, data: str | None = None, seeds: int = 4,
                depths: tuple[float, ...] = (0.0, 0.5, 1.0), span: int = DEFAULT_SPAN) -> dict:
    """The copy task on ``len(depths) * seeds`` held-out samples of ``length`` tokens, no report files: the
    conversion's built-in recall check (the same samples for the teacher and the hybrid). Returns ``score``,
    ``strict`` and what was run; ``skipped`` (a reason) when ``length`` cannot hold a span and its cue."""
    span = min(span, (length - 1) // 2)
    if span <= CUE:
        return {"task": NAME, "length": length, "skipped": f"{length} tokens cannot hold a copied span"}
    cfg = EvalConfig(lengths=[length], depths=list(depths), seeds=list(range(seeds)))
    stream = heldout_stream(tokenizer, data, max(POOL_TOKENS, 2 * length), at_least=length)
    handle = ModelHandle("check", "model", model, tokenizer, False)
    with eval_mode(model):
        scores = [score_sample(handle, s["ids"], span) for s in build_samples(stream, cfg, span)]
    return {"task": NAME, "length": length, "span": span, "samples": len(scores),
            "score": round(sum(a for a, _ in scores) / len(scores), 4),
            "strict": round(sum(b for _, b in scores) / len(scores), 4), "data": data or "wiki"}
