"""Passkey retrieval in the classic format (Landmark Attention, arXiv 2305.16300).

Prompt (plain)::

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you about the important information there.
    The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. The grass ...
    The pass key is 31415. Remember it. 31415 is the pass key.
    ... There and back again.
    What is the pass key? The pass key is

The filler is cut at sentence boundaries; the needle line goes at the boundary nearest to the
requested depth. With a chat template, the question closes the user turn and
"The pass key is" opens the assistant's reply. The key is a seeded integer in [1, 50000].
Score: the key appears in the greedy continuation (the paper's criterion). Strict: the first
integer in the continuation is the key.
"""

from __future__ import annotations

import re

import torch

from .common import (EvalConfig, EvalError, ModelHandle, Progress, eval_mode, greedy_generate, grid_summary, no_args,
                     prompt_sha1, sample_rng, tail_logits)
from .prompts import Needle, PieceEncoder, assemble, build_frame, cycle_units, make_units

NAME = "passkey"
INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
               "I will quiz you about the important information there.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"
DEFAULT_MAX_NEW_TOKENS = 12
#: the conversion's quick check draws its keys far from `linearize eval`'s seeds (0, 1, ...) and from the layer
#: probe's (1,000,000 + select.seed), so neither the layout nor a later evaluation sees its prompts
QUICK_SEED_OFFSET = 2_000_000


def parse_args(arg: str | None) -> dict:
    return no_args(NAME, arg)


def count(cfg: EvalConfig, args: dict) -> int:
    return len(cfg.lengths) * len(cfg.depths) * len(cfg.seeds)


def build_prompts(tokenizer, chat: bool, cfg: EvalConfig, args: dict | None = None) -> list[dict]:
    enc = PieceEncoder(tokenizer)
    units = make_units(enc, list(FILLER), " ")
    frame = build_frame(enc, before=INSTRUCTION + "\n", after="\n" + QUESTION, answer_prefix=ANSWER_PREFIX, chat=chat)
    out = []
    for L in cfg.lengths:
        for d in cfg.depths:
            for s in cfg.seeds:
                key = sample_rng(NAME, s, L, d).randint(1, 50000)
                needle = Needle(enc.encode_one("\n" + NEEDLE.format(key=key) + "\n"), d, ends_line=True)
                a = assemble(frame, cycle_units(units), [needle], L)
                out.append({"ids": a.ids, "row": {
                    "task": NAME, "seed": s, "length": L, "depth": d,
                    "needle_pos": a.positions[0], "needle_depth": round(a.depths[0], 5),
                    "haystack_tokens": a.haystack_tokens, "expected": [str(key)], "chat": chat,
                    "prompt_tokens": len(a.ids), "prompt_sha1": prompt_sha1(a.ids),
                }})
    return out


def answer_ids(enc: PieceEncoder, key: str) -> list[int]:
    """The key's tokens as they follow ``ANSWER_PREFIX`` in an answer: a space, then the digits."""
    return enc.encode_one(" " + key)


def score_output(output: str, key: str) -> tuple[float, float]:
    score = 1.0 if key in output else 0.0
    m = re.search(r"\d+", output)
    strict = 1.0 if m and m.group(0) == key else 0.0
    return score, strict


def run(handle: ModelHandle, cfg: EvalConfig, args: dict, progress: Progress, shared: dict) -> list[dict]:
    samples = build_prompts(handle.tokenizer, handle.chat, cfg, args)
    outs = greedy_generate(handle, [s["ids"] for s in samples], cfg.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
                           cfg.gen_batch_size, on_batch=progress.advance)
    rows = []
    for s, o in zip(samples, outs):
        text = handle.tokenizer.decode(o, skip_special_tokens=True)
        score, strict = score_output(text, s["row"]["expected"][0])
        rows.append({**s["row"], "output": text, "score": score, "strict": strict})
    return rows


def summarize(rows: list[dict], cfg: EvalConfig) -> dict:
    return grid_summary(rows, cfg)


@torch.no_grad()
def quick_check(model, tokenizer, *, length: int, seeds: int = 2,
                depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)) -> dict:
    """The passkey task on ``len(depths) * seeds`` prompts of ``length`` tokens, no report files: part of the
    conversion's built-in recall check (the same prompts for the teacher and the hybrid; the tokenizer's chat
    template when it has one, as ``eval``). A prompt scores when every token of its key is the model's argmax
    after the prompt and the key's earlier tokens -- what greedy decoding answers first -- from one forward, no
    generation. Returns ``score``, ``found`` (per prompt, 1 or 0, in a fixed order) and what was run; ``skipped`` (a
    reason) when ``length`` cannot hold a prompt."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    cfg = EvalConfig(lengths=[length], depths=list(depths), seeds=[QUICK_SEED_OFFSET + s for s in range(seeds)])
    try:
        samples = build_prompts(tokenizer, chat, cfg)
    except EvalError as e:
        return {"task": NAME, "length": length, "skipped": str(e)}
    enc = PieceEncoder(tokenizer)
    handle = ModelHandle("check", "model", model, tokenizer, chat)
    found = []
    with eval_mode(model):
        for s in samples:
            answer = answer_ids(enc, s["row"]["expected"][0])
            pred = tail_logits(handle, s["ids"] + answer, len(answer) + 1)[:-1].argmax(-1).cpu()  # [len(answer)]
            found.append(int((pred == torch.as_tensor(answer)).all()))
    return {"task": NAME, "length": length, "prompts": len(samples), "score": round(sum(found) / len(samples), 4),
            "found": found, "chat": chat}
