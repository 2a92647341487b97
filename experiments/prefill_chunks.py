"""Prefill tokens/s and peak memory of an 8B-shaped hybrid (random weights) per ``prefill_chunk_tokens``.

    python experiments/prefill_chunks.py --lengths 32K,128K --batch 1 --chunks 0,8192,16384,32768

One hybrid (``--ratio``, ``--recipe`` lolcats) is built once on the GPU; for each (T, B) and chunk size, one
untimed prefill then the median of two timed ones (``linearize.bench.model.prefill``: a fresh cache, the last
position's logits), and ``torch.cuda.max_memory_allocated`` over the three. The question it answers: what the
chunked prefill's pieces cost in speed against one whole forward, and what they save in memory, to choose the
default chunk.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from linearize import recipe as recipes
from linearize.bench.model import plan_pair, prefill
from linearize.evals.common import parse_batch_sizes, parse_lengths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b", help="a shipped config alias or a config.json")
    ap.add_argument("--ratio", default="3:1")
    ap.add_argument("--lengths", default="128K")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--chunks", default="0,8192,32768", help="prefill_chunk_tokens values (0: one whole forward)")
    ap.add_argument("--device", default="cuda", help="cuda (timed) or cpu (a check that it runs; no peak memory)")
    args = ap.parse_args()
    Ts, Bs = parse_lengths(args.lengths), parse_batch_sizes(args.batch)
    chunks = [int(c) for c in args.chunks.split(",")]
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    pair = plan_pair(args.model, against=None, random_weights=True, ratio=args.ratio, recipe=recipes.load("lolcats"),
                     dtype=dtype, device=dev, max_len=max(Ts))  # as `bench model` builds its hybrid
    model = pair.build_hybrid(pair.build_original()).eval()
    vocab = model.config.vocab_size
    where = torch.cuda.get_device_name(dev) if cuda else "CPU"
    print(f"{where} torch {torch.__version__} | {pair.hybrid_name} {args.ratio} {str(dtype)[6:]}")
    print("T,B,chunk,prefill_tok_s,peak_GiB")
    for T in Ts:
        for B in Bs:
            ids = torch.randint(0, vocab, (B, T), device=dev)
            for c in chunks:
                model.config.prefill_chunk_tokens = c
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(dev)
                try:
                    prefill(model, ids)
                    times = []
                    for _ in range(2):
                        if cuda:
                            torch.cuda.synchronize(dev)
                        t0 = time.perf_counter()
                        prefill(model, ids)
                        if cuda:
                            torch.cuda.synchronize(dev)
                        times.append(time.perf_counter() - t0)
                    rate = f"{B * T / statistics.median(times):.0f}"
                except torch.cuda.OutOfMemoryError:
                    rate = "oom"
                peak = f"{torch.cuda.max_memory_allocated(dev) / 2**30:.1f}" if cuda else "n/a"
                print(f"{T},{B},{c},{rate},{peak}", flush=True)


if __name__ == "__main__":
    main()
