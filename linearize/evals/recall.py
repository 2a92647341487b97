"""In-context key -> value recall, MQAR style (Zoology, arXiv 2312.04927).

A prompt lists ``P`` pairs ``key: value`` (keys are adjective-noun words, values distinct
4-digit numbers), then asks for them back; the reply repeats ``Q = min(P, 32)`` of the keys
in a shuffled order, each followed by its value. The reply is teacher-forced: a query counts
as recalled when every token of its value is the model's argmax prediction at that position.
One forward pass scores a whole sample, so the sweep over ``P`` (8 ... 256) is cheap; the
accuracy as ``P`` grows is the capacity curve of a fixed-size recurrent state.

Task argument: ``recall:8+16+32`` sets the pair counts. Summary: mean accuracy over the
sweep (``score``), ``by_pairs`` and ``capacity`` (largest ``P`` with accuracy >= 0.9, 0 if none).
"""

from __future__ import annotations

import torch

from linearize.units import UnitError, parse_length

from .common import EvalConfig, EvalError, ModelHandle, Progress, prompt_sha1, sample_rng, tail_logits
from .niah import _ADJ, _NOUN
from .prompts import PieceEncoder, build_frame

NAME = "recall"
DEFAULT_PAIRS = (8, 16, 32, 64, 128, 256)
MAX_QUERIES = 32
INSTRUCTION = "Memorize the value of each key in this list."
QUESTION = "Now write every key I ask for followed by its value."
CAPACITY_THRESHOLD = 0.9


def parse_args(arg: str | None) -> dict:
    if not arg:
        return {"pairs": list(DEFAULT_PAIRS)}
    try:
        pairs = sorted({parse_length(p, what="pair count") for p in arg.split("+") if p.strip()})
    except UnitError:
        raise EvalError(f"bad task 'recall:{arg}': expected pair counts joined by '+', e.g. recall:8+16+32") from None
    if not pairs or max(pairs) > len(_ADJ) * len(_NOUN):
        raise EvalError(f"bad task 'recall:{arg}': pair counts must be between 1 and {len(_ADJ) * len(_NOUN)}")
    return {"pairs": pairs}


def count(cfg: EvalConfig, args: dict) -> int:
    return len(args["pairs"]) * len(cfg.seeds)


def build_sample(enc: PieceEncoder, chat: bool, pairs: int, seed: int) -> dict:
    rng = sample_rng(NAME, pairs, seed)
    keys: list[str] = []
    seen = set()
    while len(keys) < pairs:
        k = f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}"
        if k not in seen:
            seen.add(k)
            keys.append(k)
    values = [str(v) for v in rng.sample(range(1000, 10000), pairs)]
    order = list(range(pairs))
    rng.shuffle(order)
    queries = order[:min(pairs, MAX_QUERIES)]
    frame = build_frame(enc, before=INSTRUCTION + "\n", after="\n\n" + QUESTION, answer_prefix="", chat=chat)
    ids = list(frame.head)
    for i in range(pairs):
        k_ids, v_ids = enc.encode([("" if i == 0 else "\n") + f"{keys[i]}:", f" {values[i]}"])
        ids += k_ids + v_ids
    ids += frame.tail if chat else frame.tail + enc.encode_one("\n")
    spans = []  # (start, end) of each queried value's tokens
    for j, i in enumerate(queries):
        k_ids, v_ids = enc.encode([("" if j == 0 else "\n") + f"{keys[i]}:", f" {values[i]}"])
        ids += k_ids
        spans.append((len(ids), len(ids) + len(v_ids)))
        ids += v_ids
    return {"ids": ids, "spans": spans, "row": {
        "task": NAME, "pairs": pairs, "seed": seed, "queries": len(queries),
        "query_keys": [keys[i] for i in queries], "expected": [values[i] for i in queries],
        "chat": chat, "prompt_tokens": len(ids), "prompt_sha1": prompt_sha1(ids),
    }}


@torch.no_grad()
def score_sample(handle: ModelHandle, sample: dict) -> tuple[int, list[bool]]:
    ids = sample["ids"]
    first = sample["spans"][0][0]
    k = len(ids) - first + 1  # logits from the position before the first queried value
    logits = tail_logits(handle, ids, k)  # [k, V]; row r predicts token (len - k + 1 + r)
    pred = logits.argmax(-1).tolist()
    base = len(ids) - k + 1
    hits = []
    for a, b in sample["spans"]:
        hits.append(all(pred[p - base] == ids[p] for p in range(a, b)))
    return sum(hits), hits


def run(handle: ModelHandle, cfg: EvalConfig, args: dict, progress: Progress, shared: dict) -> list[dict]:
    enc = PieceEncoder(handle.tokenizer)
    limit = handle.max_positions
    rows = []
    for P in args["pairs"]:
        for s in cfg.seeds:
            sample = build_sample(enc, handle.chat, P, s)
            n = len(sample["ids"])
            if limit and n > limit:
                rows.append({**sample["row"], "skipped": f"{n} tokens exceed the model's {limit}-token limit",
                             "correct": None, "score": None})
            else:
                correct, hits = score_sample(handle, sample)
                rows.append({**sample["row"], "correct": correct, "hits": hits, "score": correct / len(hits)})
            progress.advance()
    return rows


def summarize(rows: list[dict], cfg: EvalConfig) -> dict:
    by: dict[str, float] = {}
    tokens: dict[str, int] = {}
    for P in sorted({r["pairs"] for r in rows}):
        sel = [r["score"] for r in rows if r["pairs"] == P and r["score"] is not None]
        if sel:
            by[str(P)] = round(sum(sel) / len(sel), 6)
            tokens[str(P)] = max(r["prompt_tokens"] for r in rows if r["pairs"] == P)
    capacity = 0
    for P, acc in by.items():
        if acc >= CAPACITY_THRESHOLD:
            capacity = max(capacity, int(P))
    return {"metric": "accuracy", "higher_is_better": True,
            "score": round(sum(by.values()) / len(by), 6) if by else None,
            "by_pairs": by, "tokens_by_pairs": tokens, "capacity": capacity,
            "skipped": sorted({r["pairs"] for r in rows if r.get("skipped")})}
