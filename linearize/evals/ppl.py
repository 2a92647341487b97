"""Perplexity on held-out text with a sliding window.

One stream of held-out tokens (the embedded corpus' held-out split, or ``data``) is scored
at every context length ``L``: windows of ``L`` tokens advance by ``L // 2``; each window
scores only the tokens no earlier window scored, so every token but the first is scored
exactly once and sees between ``L/2`` and ``L`` tokens of context (``L`` for the first
window's tokens, growing from 1). The same tokens are scored at every length, so the numbers
are comparable across lengths and between models with the same tokenizer.

Several specs (``--data wiki,code,docs``, or the parts of a mixture, whose weights do not matter
here) are scored one by one, each on its own held-out tokens: one row per spec and length (``data``
names the spec). The summary then gives each domain's perplexities under ``by_data``, and as
``by_length`` / ``score`` their geometric mean (each domain counts once).

On an accelerator the windows of one shape run several to a forward, up to the longest length's tokens
(:func:`window_batches`); on a CPU one at a time.

Task argument: ``ppl:16K`` sets the number of held-out tokens (default 8K; twice the largest
length when that is more, or as much as the held-out split holds, at least one full window).
Headline score: perplexity at the largest length.
"""

from __future__ import annotations

import math

import torch

from linearize.units import UnitError, parse_length

from .common import EvalConfig, EvalError, ModelHandle, Progress, tail_logits_rows
from .corpus import data_specs, heldout_stream

NAME = "ppl"

DEFAULT_TOKENS = 8192


def parse_args(arg: str | None) -> dict:
    if not arg:
        return {"tokens": DEFAULT_TOKENS}
    try:
        return {"tokens": parse_length(arg, what="ppl token count")}
    except UnitError:
        raise EvalError(f"bad task 'ppl:{arg}': expected a token count like ppl:16K") from None


def n_tokens(cfg: EvalConfig, args: dict) -> int:
    return max(args["tokens"], 2 * max(cfg.lengths))


def windows(n: int, length: int) -> list[tuple[int, int, int]]:
    """``(begin, end, n_scored)`` for each window over ``n`` tokens; the scored tokens are the
    last ``n_scored`` of ``[begin, end)``."""
    stride = max(1, length // 2)
    out = []
    prev_end = 1  # token 0 is never scored
    begin = 0
    while prev_end < n:
        end = min(begin + length, n)
        out.append((begin, end, end - prev_end))
        prev_end = end
        begin += stride
    return out


def count(cfg: EvalConfig, args: dict) -> int:
    n = n_tokens(cfg, args)
    return len(data_specs(cfg.data)) * sum(len(windows(n, L)) for L in cfg.lengths)


@torch.no_grad()
def nll_of_windows(handle: ModelHandle, rows: torch.Tensor, n_scored: int) -> float:
    """Sum of negative log-likelihoods of the last ``n_scored`` tokens of each row of ``rows`` ``[B, T]``."""
    logits = tail_logits_rows(handle, rows, n_scored + 1)[:, :-1]  # [B, n_scored, V]: predictions of the scored
    target = rows[:, -n_scored:].to(logits.device)
    logits, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    total = 0.0
    for a in range(0, target.numel(), 2048):  # bound the log-softmax temporaries
        lp = torch.log_softmax(logits[a:a + 2048], dim=-1)
        total += float(-lp.gather(1, target[a:a + 2048, None]).sum())
    return total


def window_batches(wins: list[tuple[int, int, int]], budget: int) -> list[list[tuple[int, int, int]]]:
    """Consecutive windows of one shape (length and scored tokens) in groups of at most ``budget`` tokens (at least
    one window each), so a group's forward needs no more memory than one window of ``budget`` tokens."""
    groups: list[list[tuple[int, int, int]]] = []
    for w in wins:
        b, e, k = w
        last = groups[-1] if groups else None
        if last and (len(last) + 1) * (e - b) <= budget and (last[0][1] - last[0][0], last[0][2]) == (e - b, k):
            last.append(w)
        else:
            groups.append([w])
    return groups


def run(handle: ModelHandle, cfg: EvalConfig, args: dict, progress: Progress, shared: dict) -> list[dict]:
    specs = data_specs(cfg.data)
    if len(specs) == 1:
        return _run_one(handle, cfg, args, progress, cfg.data, cfg.data or "wiki")
    return [row for spec in specs for row in _run_one(handle, cfg, args, progress, spec, spec)]


def _run_one(handle: ModelHandle, cfg: EvalConfig, args: dict, progress: Progress, spec: str | None,
             label: str) -> list[dict]:
    """The rows of one data spec, one per length (``data`` = ``label``)."""
    stream = heldout_stream(handle.tokenizer, spec, n_tokens(cfg, args), at_least=max(cfg.lengths) + 1)
    n = stream.numel()
    # windows share a forward up to the longest length asked for (the memory one such window needs anyway), on an
    # accelerator only: on a CPU batching measured no faster (the embedded model, 16K tokens at 1K / 2K: 77.8 s in
    # 4K-token batches, 90.8 s in 16K-token ones, 77.5 s a window at a time)
    budget = 0 if torch.device(handle.device).type == "cpu" else max(cfg.lengths)
    rows = []
    for L in cfg.lengths:
        nll = 0.0
        scored = 0
        wins = windows(n, L)
        for group in window_batches(wins, budget):
            k = group[0][2]
            nll += nll_of_windows(handle, torch.stack([stream[b:e] for b, e, _ in group]), k)
            scored += k * len(group)
            progress.advance(len(group))
        mean = nll / scored
        rows.append({"task": NAME, "length": L, "tokens": scored, "windows": len(wins), "stride": max(1, L // 2),
                     "nll": round(mean, 6), "ppl": round(math.exp(mean), 4), "data": label})
    return rows


def summarize(rows: list[dict], cfg: EvalConfig) -> dict:
    specs = list(dict.fromkeys(r["data"] for r in rows))
    if len(specs) > 1:
        return _summarize_domains(rows, specs)
    by = {str(r["length"]): r["ppl"] for r in rows}
    top = max(rows, key=lambda r: r["length"])
    return {"metric": "ppl", "higher_is_better": False, "score": top["ppl"], "by_length": by,
            "nll_by_length": {str(r["length"]): r["nll"] for r in rows}, "tokens": top["tokens"], "data": top["data"]}


def _summarize_domains(rows: list[dict], specs: list[str]) -> dict:
    """Several data specs: each one's perplexities (``by_data``), and their geometric mean per length."""
    lengths = sorted({r["length"] for r in rows})
    nll = {d: {str(r["length"]): r["nll"] for r in rows if r["data"] == d} for d in specs}
    mean = {str(L): sum(nll[d][str(L)] for d in specs) / len(specs) for L in lengths}
    top = str(lengths[-1])
    return {"metric": "ppl", "higher_is_better": False, "score": round(math.exp(mean[top]), 4),
            "by_length": {k: round(math.exp(v), 4) for k, v in mean.items()},
            "nll_by_length": {k: round(v, 6) for k, v in mean.items()},
            "by_data": {d: {str(r["length"]): r["ppl"] for r in rows if r["data"] == d} for d in specs},
            "nll_by_data": nll,
            "tokens_by_data": {d: max(r["tokens"] for r in rows if r["data"] == d) for d in specs},
            "tokens": sum(max(r["tokens"] for r in rows if r["data"] == d) for d in specs), "data": ",".join(specs)}
