"""Agreement with the original model on text the original generated.

For every length ``L`` and seed, a held-out passage of ``L - G`` tokens (seeded start) is
continued by the *original* (``against``) for ``G`` tokens (sampling, temperature 0.8,
``torch.manual_seed(seed)``). Both models then read the same ``L`` tokens with teacher
forcing, and at the ``G`` generated positions we compare their next-token distributions:

* ``kl``: mean KL(original || model) in nats per token;
* ``top1``: fraction of positions where both models' argmax agree;
* ``nll``: the model's mean negative log-likelihood of the original's tokens.

The original's log-probabilities are kept on the CPU (float32, ``G x vocab`` per sample)
between the two passes, so only one model is in memory at a time. The original's own row is
its agreement with itself (kl 0, top1 1), which makes the side-by-side table read naturally.
Task argument: ``agreement:128`` sets ``G`` (default 64). Headline score: ``top1``.
"""

from __future__ import annotations

import torch

from linearize.units import UnitError, parse_length

from .common import EvalConfig, EvalError, ModelHandle, Progress, prompt_sha1, sample_rng, tail_logits
from .corpus import heldout_stream

NAME = "agreement"
DEFAULT_TOKENS = 64
TEMPERATURE = 0.8


def parse_args(arg: str | None) -> dict:
    if not arg:
        return {"tokens": DEFAULT_TOKENS}
    try:
        return {"tokens": parse_length(arg, what="agreement token count")}
    except UnitError:
        raise EvalError(f"bad task 'agreement:{arg}': expected a generated-token count like agreement:64") from None


def count(cfg: EvalConfig, args: dict) -> int:
    return len(cfg.lengths) * len(cfg.seeds)


def _stream_len(cfg: EvalConfig) -> int:
    return max(cfg.lengths) + 4096


@torch.no_grad()
def _generate_original(handle: ModelHandle, prompt: torch.Tensor, n: int, seed: int) -> list[int]:
    # start-up time: transformers, only when a task generates
    from transformers import GenerationConfig  # noqa: PLC0415

    x = prompt.to(handle.device).reshape(1, -1)
    cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=True, temperature=TEMPERATURE,
                           top_k=0, top_p=1.0, pad_token_id=handle.pad_id, eos_token_id=handle.eos_ids or None)
    torch.manual_seed(seed)
    out = handle.model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=cfg)
    return out[0, x.shape[1]:].tolist()


def _logprobs(handle: ModelHandle, ids: list[int], g: int) -> torch.Tensor:
    """log-softmax at the ``g`` positions that predict the last ``g`` tokens: ``[g, V]`` float32."""
    logits = tail_logits(handle, ids, g + 1)[:-1]
    return torch.log_softmax(logits, dim=-1)


def _compare(ref: torch.Tensor, lp: torch.Tensor, targets: list[int]) -> dict:
    ref = ref.float()
    lp = lp.float().to(ref.device)
    v = min(ref.shape[-1], lp.shape[-1])  # padded vocabularies: compare the shared part
    ref, lp = ref[:, :v], lp[:, :v]
    kl = (ref.exp() * (ref - lp)).sum(-1).clamp_min(0)
    top1 = (ref.argmax(-1) == lp.argmax(-1)).float()
    t = torch.tensor(targets, dtype=torch.long)
    nll = -lp.gather(1, t[:, None])[:, 0]
    return {"kl": round(float(kl.mean()), 6), "top1": round(float(top1.mean()), 6), "nll": round(float(nll.mean()), 6)}


def run(handle: ModelHandle, cfg: EvalConfig, args: dict, progress: Progress, shared: dict) -> list[dict]:
    g = args["tokens"]
    store = shared.setdefault(NAME, {})
    if handle.role == "against":
        stream = heldout_stream(handle.tokenizer, cfg.data, _stream_len(cfg), at_least=max(cfg.lengths))
        store["vocab"] = len(handle.tokenizer)
    else:
        if not store:
            raise EvalError("task 'agreement' needs against= (--against SPEC): the original generates the text")
        if len(handle.tokenizer) != store["vocab"]:
            raise EvalError(f"task 'agreement' needs the same tokenizer for both models: {len(handle.tokenizer)} vs {store['vocab']} tokens")
    rows = []
    for L in cfg.lengths:
        if g >= L:
            raise EvalError(f"task 'agreement:{g}': the generated tokens must be fewer than the shortest length {L}")
        for s in cfg.seeds:
            key = (L, s)
            if handle.role == "against":
                start = sample_rng(NAME, L, s).randrange(0, stream.numel() - (L - g) + 1)
                prompt = stream[start:start + L - g]
                gen = _generate_original(handle, prompt, g, s)
                ids = prompt.tolist() + gen
                ref = _logprobs(handle, ids, g)
                store[key] = {"ids": ids, "start": start, "gen": gen, "ref": ref.to("cpu")}
                lp = ref
            else:
                item = store[key]
                ids, start, gen = item["ids"], item["start"], item["gen"]
                lp = _logprobs(handle, ids, g)
                ref = item["ref"]
            m = _compare(ref.cpu(), lp.cpu(), gen)
            rows.append({"task": NAME, "length": L, "seed": s, "start": start, "generated": gen,
                         "prompt_tokens": len(ids) - g, "prompt_sha1": prompt_sha1(ids), **m})
            progress.advance()
    return rows


def summarize(rows: list[dict], cfg: EvalConfig) -> dict:
    def mean(key, sel):
        return round(sum(r[key] for r in sel) / len(sel), 6)

    by = {}
    out = {"metric": "top1", "higher_is_better": True, "score": mean("top1", rows),
           "kl": mean("kl", rows), "nll": mean("nll", rows), "by_length": by, "kl_by_length": {}}
    for L in cfg.lengths:
        sel = [r for r in rows if r["length"] == L]
        if sel:
            by[str(L)] = mean("top1", sel)
            out["kl_by_length"][str(L)] = mean("kl", sel)
    return out
