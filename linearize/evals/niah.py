"""Needle in a haystack, RULER style (arXiv 2404.06654).

Needles read ``"One of the special magic {numbers|words|uuids} for {key} is: {value}."``.
A *variant* is ``KIND-HAYSTACK-VALUES``:

* KIND: ``single`` (one needle), ``multikey`` (the queried needle plus 3 needles for other
  keys), ``multivalue`` (4 values for the queried key, all expected), ``multiquery``
  (4 keys, all queried);
* HAYSTACK: ``filler`` (the repeated "The grass is green. ..." block, one per line) or
  ``prose`` (sentences of the held-out embedded Wikipedia corpus);
* VALUES: ``numbers`` (7 digits), ``words`` (adjective-noun), ``uuids``.

Missing parts default to ``prose`` and ``numbers`` (``single`` = ``single-prose-numbers``).
``niah`` alone runs :data:`DEFAULT_VARIANTS` (single, multikey, multivalue, multiquery on prose
with numbers); ``niah:single-filler+multikey-prose-uuids`` picks variants.
The first queried needle goes at the requested depth; the others at seeded random depths.
Score: fraction of expected values found in the greedy output (case-insensitive substring).
Strict: the planted values found in the output as whole tokens (case-sensitive) are exactly
the expected ones (no miss, no distractor).
"""

from __future__ import annotations

import uuid as _uuid
from dataclasses import dataclass

from .common import (EvalConfig, EvalError, ModelHandle, Progress, greedy_generate, grid_summary, prompt_sha1, sample_rng,
                     substring_score, whole_match)
from .corpus import prose_sentences
from .prompts import Needle, PieceEncoder, assemble, build_frame, cycle_units, make_units

NAME = "niah"
KINDS = ("single", "multikey", "multivalue", "multiquery")
HAYSTACKS = ("filler", "prose")
VALUE_TYPES = ("numbers", "words", "uuids")
DEFAULT_VARIANTS = (
    "single-prose-numbers",
    "multikey-prose-numbers",
    "multivalue-prose-numbers",
    "multiquery-prose-numbers",
)
FILLER_BLOCK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type} for {key} is: {value}."
_DISTRACTOR_DEPTHS = [round(i / 39, 4) for i in range(40)]

_ADJ = (
    "amber brave calm damp eager faint gentle hollow icy jolly keen lively mellow narrow odd proud quiet "
    "rapid silent tidy upper vivid wary young zesty ancient bitter crisp dusty elegant fierce golden humble "
    "idle jagged kind lofty misty noble olive polite rusty shiny stormy tender urban velvet wild woolly "
    "bold cheerful clever cosmic frosty giant hidden lunar marble purple rough sandy scarlet sleepy solar"
).split()
_NOUN = (
    "anchor badge candle desk engine falcon garden harbor island jacket kettle lantern meadow needle orchard "
    "pencil quartz river saddle tunnel umbrella valley wagon yacht zebra acorn basket cabin dragon feather "
    "glacier hammer kitten ladder magnet nutmeg otter parrot rocket salmon teapot violin walrus bridge canyon "
    "dolphin forest helmet jungle lemon mirror planet ribbon spider tiger tulip window compass"
).split()


@dataclass(frozen=True)
class Variant:
    kind: str
    haystack: str
    values: str

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.haystack}-{self.values}"

    @property
    def n_expected(self) -> int:
        return 4 if self.kind in ("multivalue", "multiquery") else 1

    def default_max_new_tokens(self) -> int:
        """Enough for the values and their separators (digit-per-token tokenizers included)."""
        per = {"numbers": 16, "words": 16, "uuids": 40}[self.values]
        return 8 + per * self.n_expected


def parse_variant(text: str) -> Variant:
    parts = [p for p in text.strip().lower().split("-") if p] if text.strip() else []
    # 'uuids' values contain no '-', so a plain split works
    if not parts or parts[0] not in KINDS:
        raise EvalError(f"bad niah variant {text!r}: expected KIND[-HAYSTACK[-VALUES]] with KIND one of {', '.join(KINDS)}")
    kind = parts[0]
    hay = parts[1] if len(parts) > 1 else "prose"
    vals = parts[2] if len(parts) > 2 else "numbers"
    if hay not in HAYSTACKS:
        raise EvalError(f"bad niah haystack {hay!r} in {text!r}: expected one of {', '.join(HAYSTACKS)}")
    if vals not in VALUE_TYPES:
        raise EvalError(f"bad niah value type {vals!r} in {text!r}: expected one of {', '.join(VALUE_TYPES)}")
    if len(parts) > 3:
        raise EvalError(f"bad niah variant {text!r}: expected KIND[-HAYSTACK[-VALUES]], e.g. single-filler-numbers")
    return Variant(kind, hay, vals)


def parse_args(arg: str | None) -> dict:
    """``niah`` -> the default variants; ``niah:single-filler+multikey-prose-uuids`` -> those."""
    names = [a for a in (arg or "").split("+") if a.strip()] or list(DEFAULT_VARIANTS)
    variants = list(dict.fromkeys(parse_variant(a) for a in names))
    return {"variants": variants}


def _random_word(rng) -> str:
    return f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}"


def _random_value(rng, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":
        return _random_word(rng)
    return str(_uuid.UUID(int=rng.getrandbits(128), version=4))


def _distinct(rng, n: int, make, avoid=()) -> list[str]:
    out: list[str] = []
    seen = set(avoid)
    while len(out) < n:
        v = make(rng)
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


class _Builder:
    """Per-tokenizer prompt builder (caches encoded haystack units)."""

    def __init__(self, tokenizer, chat: bool):
        self.enc = PieceEncoder(tokenizer)
        self.chat = chat
        self._units: dict[str, list] = {}

    def units(self, haystack: str):
        if haystack not in self._units:
            if haystack == "filler":
                self._units[haystack] = make_units(self.enc, [FILLER_BLOCK], "\n")
            else:
                self._units[haystack] = make_units(self.enc, list(prose_sentences()), " ")
        return self._units[haystack]

    def build(self, variant: Variant, seed: int, length: int, depth: float) -> dict:
        rng = sample_rng(NAME, variant.name, seed, length, depth)
        n_keys = 4 if variant.kind in ("multikey", "multiquery") else 1
        n_vals = 4 if variant.kind == "multivalue" else 1
        keys = _distinct(rng, n_keys, _random_word)
        values = [_distinct(rng, n_vals, lambda r: _random_value(r, variant.values), avoid=keys) for _ in keys]
        # values must be globally distinct
        flat = [v for vs in values for v in vs]
        if len(set(flat)) != len(flat):  # pragma: no cover - astronomically rare
            values = [[f"{v}{i}{j}" if variant.values == "numbers" else v for j, v in enumerate(vs)] for i, vs in enumerate(values)]
        queried = list(range(n_keys)) if variant.kind == "multiquery" else [0]
        tname = variant.values
        needles_text = []  # (key index, value index, text)
        for i, k in enumerate(keys):
            for j, v in enumerate(values[i]):
                needles_text.append((i, j, NEEDLE.format(type=tname, key=k, value=v)))
        # the primary needle (first queried key, first value) goes at the requested depth
        depths = [depth] + [rng.choice(_DISTRACTOR_DEPTHS) for _ in needles_text[1:]]
        sep = "\n" if variant.haystack == "filler" else " "
        needle_ids = self.enc.encode([sep + t for _, _, t in needles_text])
        needles = [Needle(ids, d) for ids, d in zip(needle_ids, depths)]
        expected = [v for i in queried for v in values[i]]
        distractors = [v for i, vs in enumerate(values) for v in vs if v not in expected]
        qkeys = [keys[i] for i in queried]
        query = qkeys[0] if len(qkeys) == 1 else ", ".join(qkeys[:-1]) + ", and " + qkeys[-1]
        if len(expected) == 1:
            t1 = tname[:-1]
            before = f"A special magic {t1} is hidden within the following text. Make sure to memorize it. I will quiz you about the {t1} afterwards.\n"
            after = f"\nWhat is the special magic {t1} for {query} mentioned in the provided text?"
            prefix = f"The special magic {t1} for {query} mentioned in the provided text is"
        else:
            before = f"Some special magic {tname} are hidden within the following text. Make sure to memorize it. I will quiz you about the {tname} afterwards.\n"
            after = f"\nWhat are all the special magic {tname} for {query} mentioned in the provided text?"
            prefix = f"The special magic {tname} for {query} mentioned in the provided text are"
        frame = build_frame(self.enc, before=before, after=after, answer_prefix=prefix, chat=self.chat, plain_answer_sep="\nAnswer: ")
        units = self.units(variant.haystack)
        start = 0 if variant.haystack == "filler" else rng.randrange(len(units))
        a = assemble(frame, cycle_units(units, start), needles, length)
        return {
            "ids": a.ids,
            "row": {
                "task": NAME, "variant": variant.name, "seed": seed, "length": length, "depth": depth,
                "needle_pos": a.positions[0], "needle_depth": round(a.depths[0], 5),
                "needle_positions": a.positions, "haystack_tokens": a.haystack_tokens, "haystack_start": start,
                "keys": keys, "query": qkeys, "expected": expected, "distractors": distractors,
                "chat": self.chat, "prompt_tokens": len(a.ids), "prompt_sha1": prompt_sha1(a.ids),
            },
        }


def build_prompts(tokenizer, chat: bool, cfg: EvalConfig, args: dict) -> list[dict]:
    """Every sample of the grid variants x lengths x depths x seeds (deterministic)."""
    b = _Builder(tokenizer, chat)
    return [b.build(v, s, L, d) for v in args["variants"] for L in cfg.lengths for d in cfg.depths for s in cfg.seeds]


def count(cfg: EvalConfig, args: dict) -> int:
    return len(args["variants"]) * len(cfg.lengths) * len(cfg.depths) * len(cfg.seeds)


def score_output(output: str, expected: list[str], distractors: list[str]) -> tuple[float, float]:
    score = substring_score(output, expected)
    found = {v for v in expected + distractors if whole_match(output, v)}
    strict = 1.0 if found == set(expected) else 0.0
    return score, strict


def run(handle: ModelHandle, cfg: EvalConfig, args: dict, progress: Progress, shared: dict) -> list[dict]:
    samples = build_prompts(handle.tokenizer, handle.chat, cfg, args)
    enc_dec = handle.tokenizer
    rows = []
    by_variant: dict[str, list[dict]] = {}
    for s in samples:
        by_variant.setdefault(s["row"]["variant"], []).append(s)
    for vname, group in by_variant.items():
        v = parse_variant(vname)
        mnt = cfg.max_new_tokens or v.default_max_new_tokens()
        outs = greedy_generate(handle, [s["ids"] for s in group], mnt, cfg.gen_batch_size, on_batch=progress.advance)
        for s, o in zip(group, outs):
            text = enc_dec.decode(o, skip_special_tokens=True)
            score, strict = score_output(text, s["row"]["expected"], s["row"]["distractors"])
            rows.append({**s["row"], "output": text, "score": score, "strict": strict})
    return rows


def summarize(rows: list[dict], cfg: EvalConfig) -> dict:
    out = grid_summary(rows, cfg)
    variants: dict[str, list[dict]] = {}
    for r in rows:
        variants.setdefault(r["variant"], []).append(r)
    out["by_variant"] = {k: grid_summary(v, cfg, with_grid=False) for k, v in variants.items()}
    return out
