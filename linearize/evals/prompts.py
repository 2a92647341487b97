"""Prompt construction with exact lengths in the model's own tokens.

A long-context prompt is assembled from token pieces::

    head  | haystack units (needles inserted between units) | tail

* ``head`` / ``tail`` come from a :class:`Frame`: the instruction before the context and
  the question + answer prefix after it, wrapped in the tokenizer's chat template when the
  model is an instruct model (the answer prefix then opens the assistant turn).
* Every piece of text is encoded *in context* (after a fixed sentence, whose tokens are
  then dropped), so a piece such as ``" The grass is green."`` gets the tokens it would get
  inside running text, for byte-level BPE and SentencePiece tokenizers alike.
* Haystack units (filler sentences or corpus sentences) carry their leading separator.
  The first unit is cut from the front to hit the target length exactly, so a prompt of
  length ``L`` has exactly ``L`` tokens. Needles go between units, at the unit boundary
  nearest to the requested depth; the actual token position is returned.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterator, Sequence

from .common import EvalError

_CONTEXT = "This is a sentence."
_SENTINEL = "\u2063CONTEXT\u2063"


class PieceEncoder:
    """Encode text pieces as they would be tokenized inside running text."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._ctx = self._raw([_CONTEXT])[0]
        self._cache: dict[str, list[int]] = {}
        probe = tokenizer("a", add_special_tokens=True)["input_ids"]
        bare = tokenizer("a", add_special_tokens=False)["input_ids"]
        bos = getattr(tokenizer, "bos_token_id", None)
        # plain (non-chat) prompts start with BOS only when the tokenizer itself adds one
        self.bos: list[int] = [bos] if bos is not None and len(probe) > len(bare) and probe[0] == bos else []

    def _raw(self, texts: list[str]) -> list[list[int]]:
        return [list(x) for x in self.tok(texts, add_special_tokens=False)["input_ids"]]

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        todo = [t for t in dict.fromkeys(texts) if t not in self._cache]
        if todo:
            n = len(self._ctx)
            joint = self._raw([_CONTEXT + t for t in todo])
            for t, ids in zip(todo, joint):
                if ids[:n] == self._ctx:
                    self._cache[t] = ids[n:]
                else:  # the piece merged with the context: fall back to encoding it alone
                    self._cache[t] = self._raw([t])[0]
        return [self._cache[t] for t in texts]

    def encode_one(self, text: str) -> list[int]:
        return self.encode([text])[0]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


@dataclass
class Frame:
    """The token ids around the context: ``head`` before it, ``tail`` after it."""

    head: list[int]
    tail: list[int]
    chat: bool


def build_frame(enc: PieceEncoder, *, before: str, after: str, answer_prefix: str, chat: bool,
                plain_answer_sep: str = " ") -> Frame:
    """Wrap ``before + CONTEXT + after`` (a user message) and the ``answer_prefix`` (the
    start of the reply) either in the chat template or as plain text.

    Plain: ``before CONTEXT after{plain_answer_sep}answer_prefix``.
    Chat: the template applied to the user message with the generation prompt, then
    ``answer_prefix`` as the beginning of the assistant's turn."""
    tok = enc.tok
    if chat:
        msgs = [{"role": "user", "content": before + _SENTINEL + after}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str) or text.count(_SENTINEL) != 1:
            raise EvalError("the tokenizer's chat template did not keep the message text intact; pass chat_template=False (--no-chat-template)")
        head_text, tail_text = text.split(_SENTINEL)
        head = list(tok(head_text, add_special_tokens=False)["input_ids"])
        tail = enc.encode_one(tail_text + answer_prefix)
    else:
        head = enc.bos + list(tok(before, add_special_tokens=False)["input_ids"]) if before else list(enc.bos)
        tail = enc.encode_one(after + plain_answer_sep + answer_prefix if answer_prefix else after)
    return Frame(head=head, tail=tail, chat=chat)


@dataclass
class Unit:
    """One haystack unit (a sentence or a block of filler): ids with its leading separator and
    ``bare`` ids without it (used at the very start and after a needle that ends a line)."""

    ids: list[int]
    bare: list[int]


@dataclass
class Needle:
    ids: list[int]
    depth: float  # requested fraction of the haystack before the needle
    ends_line: bool = False  # the needle text ends with a newline


@dataclass
class Assembled:
    ids: list[int]
    positions: list[int]  # token index of each needle's first token, in the order given
    depths: list[float]  # actual fraction of haystack tokens before each needle
    context_start: int  # index of the first context token (= len(head))
    haystack_tokens: int  # haystack tokens, excluding needles


def make_units(enc: PieceEncoder, texts: Sequence[str], sep: str) -> list[Unit]:
    """Encode haystack texts (sentences or blocks) as units with separator ``sep``."""
    withsep = enc.encode([sep + t for t in texts])
    bare = enc.encode(list(texts))
    return [Unit(a, b) for a, b in zip(withsep, bare)]


def assemble(frame: Frame, units: Iterator[Unit], needles: Sequence[Needle], length: int) -> Assembled:
    """Exactly ``length`` tokens: head + haystack with needles + tail.

    ``units`` is an (endless) iterator; units are taken until the haystack budget is filled,
    then the first one is cut from the front. Each needle lands at the unit boundary nearest
    to ``depth * haystack_tokens`` (boundary 0, before the cut first unit, is not used)."""
    fixed = len(frame.head) + len(frame.tail) + sum(len(n.ids) for n in needles)
    budget = length - fixed
    min_needed = fixed + 8
    if budget < 8:
        raise EvalError(f"length {length} is too short for this prompt: it needs at least {min_needed} tokens")
    taken: list[Unit] = []
    total = 0
    while total < budget:
        try:
            u = next(units)
        except StopIteration:  # pragma: no cover - sources are endless
            raise EvalError("the haystack source ran out of text") from None
        if not u.ids:
            continue
        taken.append(u)
        total += len(u.ids)
    # the first unit is used bare and cut from the front to hit the budget exactly
    lens = [len(u.ids) for u in taken]
    first = taken[0].bare
    rest = sum(lens[1:])
    while rest >= budget:  # the first unit is not needed at all
        taken.pop(0)
        lens.pop(0)
        first = taken[0].bare
        rest = sum(lens[1:])
    cut = len(first) - (budget - rest)
    if cut < 0:  # the bare form is shorter than needed (rare): keep the separator form
        first = taken[0].ids
        cut = len(first) - (budget - rest)
        if cut < 0:
            raise EvalError(f"could not fill the haystack to {length} tokens")  # pragma: no cover
    pieces: list[list[int]] = [first[cut:]] + [u.ids for u in taken[1:]]
    # boundaries between units, in haystack-token coordinates (unit i starts at starts[i])
    starts = [0]
    for p in pieces:
        starts.append(starts[-1] + len(p))
    hay = starts[-1]
    assert hay == budget
    cand = starts[1:]  # boundary before unit 1 .. end of haystack
    slot_of: list[int] = []
    for n in needles:
        target = n.depth * hay
        j = bisect.bisect_left(cand, target)
        best = min((k for k in (j - 1, j) if 0 <= k < len(cand)), key=lambda k: (abs(cand[k] - target), k))
        slot_of.append(best + 1)  # insert before pieces[slot]
    # after a needle that ends a line, the next unit goes bare when that keeps the length
    bare_after = set()
    for n, s in zip(needles, slot_of):
        if n.ends_line and s < len(pieces):
            u = taken[s]
            if len(u.bare) == len(u.ids):
                bare_after.add(s)
    ids = list(frame.head)
    positions = [0] * len(needles)
    depths = [0.0] * len(needles)
    hay_before = 0
    by_slot: dict[int, list[int]] = {}
    for i, s in enumerate(slot_of):
        by_slot.setdefault(s, []).append(i)
    for k in range(len(pieces) + 1):
        for i in by_slot.get(k, []):
            positions[i] = len(ids)
            depths[i] = hay_before / hay
            ids.extend(needles[i].ids)
        if k < len(pieces):
            p = taken[k].bare if k in bare_after else pieces[k]
            ids.extend(p)
            hay_before += len(p)
    ids.extend(frame.tail)
    assert len(ids) == length, (len(ids), length)
    return Assembled(ids=ids, positions=positions, depths=depths, context_start=len(frame.head), haystack_tokens=hay)


def cycle_units(units: Sequence[Unit], start: int = 0) -> Iterator[Unit]:
    """Endless iterator over ``units`` starting at index ``start``."""
    n = len(units)
    if n == 0:
        raise EvalError("empty haystack source")
    i = start % n
    while True:
        yield units[i]
        i = (i + 1) % n
