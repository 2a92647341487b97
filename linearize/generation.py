"""Streaming generation for `linearize generate`: greedy or sampled, optionally with prompt-lookup drafts."""

from __future__ import annotations

from threading import Thread
from typing import Iterator

import torch

from .io.sources import input_device, load_model, placement


def build_inputs(tokenizer, prompt: str, chat: bool) -> torch.Tensor:
    """Token ids ``[1, T]`` for a prompt, through the chat template when asked and available."""
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer(prompt, return_tensors="pt").input_ids


def generation_kwargs(*, temperature: float = 0.0, top_p: float = 1.0, prompt_lookup: int = 0) -> dict:
    """``generate()`` arguments: greedy at temperature 0, else sampling (nucleus ``top_p``); ``prompt_lookup`` > 0
    drafts that many tokens (at most ``CROP_TOKENS``, what a linear layer's cache can take back on every supported
    transformers release) from n-gram matches in the prompt (transformers' prompt-lookup decoding: the drafts are
    checked in one forward and rejected ones taken back with ``HybridCache.crop``)."""
    # start-up time: the model code imports transformers; a bad spec is one line before it loads
    from .model.cache import CROP_TOKENS

    kw: dict = {"do_sample": temperature > 0}
    if temperature > 0:
        kw.update(temperature=temperature, top_p=top_p, top_k=0)  # top_k 0: no top-k cut (only top_p)
    if prompt_lookup > 0:
        kw["prompt_lookup_num_tokens"] = min(prompt_lookup, CROP_TOKENS)
    return kw


def stream_generate(spec: str, prompt: str, *, max_new_tokens: int = 64, chat: bool = True, temperature: float = 0.0,
                    top_p: float = 1.0, seed: int = 0, prompt_lookup: int = 0, dtype=None, device=None,
                    max_memory=None, offload_dir=None, log=None) -> Iterator[str]:
    """Yield decoded text pieces as the model generates them (:func:`generation_kwargs`; ``seed`` makes sampling
    repeatable). ``max_memory``/``offload_dir``: layer-wise onloading for a model that does not fit (see
    :func:`~linearize.io.sources.load_model`); ``log`` then gets one line saying where the layers went."""
    # start-up time: the model code imports transformers; a bad spec is one line before it loads
    from transformers import TextIteratorStreamer

    model, tokenizer = load_model(spec, dtype=dtype, device=device, max_memory=max_memory, offload_dir=offload_dir)
    if max_memory is not None and log is not None:
        log(f"placement: {placement(model)}")
    ids = build_inputs(tokenizer, prompt, chat).to(input_device(model))  # not model.device: meta when offloaded
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                  streamer=streamer, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                  **generation_kwargs(temperature=temperature, top_p=top_p, prompt_lookup=prompt_lookup))
    torch.manual_seed(seed)
    errors: list[BaseException] = []

    def run():
        try:
            with torch.inference_mode():
                model.generate(**kwargs)
        except BaseException as e:  # surfaced in the caller's thread
            errors.append(e)
            streamer.end()

    thread = Thread(target=run, daemon=True)
    thread.start()
    yield from streamer
    thread.join()
    if errors:
        raise errors[0]
