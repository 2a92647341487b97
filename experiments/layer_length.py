"""How far a converted layer's fit holds beyond the length it was trained at (CPU, minutes per layer).

Stage 1 for one layer alone: the original SmolLM2-135M reads packed `wiki` training rows of ``--train-length``
tokens and held-out rows of ``--eval-length`` tokens once, the inputs of the chosen layers are kept, and a fresh
lolcats layer (Hedgehog maps, 64-token window, optional decay gate) is fitted to the layer's own softmax output
with the recipe's optimizer settings (AdamW, lr 1e-2, 10 warmup steps, cosine to 0.1). Printed per layer: the
held-out normalized output error |o - o_softmax|^2 / |o_softmax|^2 by query position (0-2K, 2-4K, 4-8K, 8-16K),
the fitted window weight and, with a decay gate, each KV head's median half-life in tokens.

    python experiments/layer_length.py --layers 3 --train-length 2K              # today's training length
    python experiments/layer_length.py --layers 3 --train-length 8K --rows 12    # the same tokens at 8K
    python experiments/layer_length.py --layers 3 --train-length 2K,8K --rows 24,6   # half the tokens at each
    python experiments/layer_length.py --layers 3 --set decay=learned --set decay_half_life=512
    python experiments/layer_length.py --layers 3 --sinks 4   # + the first 4 tokens in the exact-softmax part
    python experiments/layer_length.py --layers 3 --mass      # + where the original attention's weight goes
    python experiments/layer_length.py --layers 3 --eval-length 2K --eval-data wiki,books,code   # other domains
    python experiments/layer_length.py --layers 3 --data wiki:0.5,books:0.5 --eval-data wiki,books,code

``--sinks N`` fits the layer with N attention sinks (``attention.sinks``: the first N tokens in the exact-softmax
part for every query). ``--mass`` computes the fitted layer's split in its quadratic form (the window and the
sinks exact, the rest linear, one shared normalizer).
``--data`` is the training text (any ``--data`` spec, mixtures too), ``--eval-data`` one held-out row per named
corpus, each reported on its own line. The captured inputs are cached in ``--cache`` (default: a file per setting
under the system's temp folder).
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import torch
import yaml

from linearize.data.packing import heldout_sequences, packed_batches
from linearize.io.sources import load_model
from linearize.model.architectures import arch_spec
from linearize.model.attention import LinearAttention
from linearize.units import parse_length

LOLCATS = {"feature_map": "hedgehog", "window": 64, "window_init": 0.1, "eps": 1e-6, "decay": "none"}


def capture(model, ids: torch.Tensor, layers: list[int]) -> dict:
    """{layer: (input hidden states [1, T, hidden], rotary (cos, sin))} of one row, stopping after the last layer."""
    class Done(Exception):
        pass

    got = {}

    def hook(mod, args, kwargs):
        got[mod.layer_idx] = (kwargs["hidden_states"].detach(), tuple(t.detach() for t in kwargs["position_embeddings"]))
        if mod.layer_idx == max(layers):
            raise Done

    hooks = [model.model.layers[i].self_attn.register_forward_pre_hook(hook, with_kwargs=True) for i in layers]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    except Done:
        pass
    finally:
        for h in hooks:
            h.remove()
    return got


def quadratic(m: LinearAttention, x, q, k, v, sinks: int, rows: int = 1024, shares: list | None = None) -> torch.Tensor:
    """The window hybrid with the first ``sinks`` keys also in the exact-softmax part, ``[1, T, H, V]``; ``shares``
    (a list) receives the linear part's share of the normalizer per query, ``[T]`` (mean over heads)."""
    T, H, Hk = q.shape[1], q.shape[2], k.shape[2]
    G, W = H // Hk, m.window
    fq = m.features(m.feature_map_q, q)[0].transpose(0, 1)  # [H, T, F]
    fk = m.features(m.feature_map_k, k)[0].transpose(0, 1).repeat_interleave(G, 0)
    qh = q[0].transpose(0, 1)
    kh, vh = (t[0].transpose(0, 1).repeat_interleave(G, 0) for t in (k, v))  # [H, T, D]
    b = m.decay(x)[0].cumsum(0).transpose(0, 1).repeat_interleave(G, 0) if m.decay is not None else None  # [H, T]
    wf = torch.sigmoid(m.window_logit).view(H, 1, 1)
    j = torch.arange(T)
    out = []
    for a in range(0, T, rows):
        i = torch.arange(a, min(a + rows, T))
        diff = i[:, None] - j[None, :]
        sink = (j[None, :] < sinks) & (diff >= 0)
        exact = ((diff >= 0) & (diff < W)) | sink
        lin = (diff >= W) & ~sink
        s = ((qh[:, i] @ kh.transpose(1, 2)) * m.scaling).masked_fill(~exact, float("-inf"))
        mx = s.amax(-1, keepdim=True).clamp_min(0).detach()
        p = torch.exp(s - mx)
        al = fq[:, i] @ fk.transpose(1, 2)
        if b is not None:
            al = al * torch.exp((b[:, i, None] - b[:, None, :]).masked_fill(~lin, -float("inf")))
        al = al.masked_fill(~lin, 0.0) * torch.exp(-mx)
        num = wf * (p @ vh) + (1 - wf) * (al @ vh)
        den = wf * p.sum(-1, keepdim=True) + (1 - wf) * al.sum(-1, keepdim=True) + m.eps * torch.exp(-mx)
        out.append(num / den)
        if shares is not None:
            shares.append(((1 - wf) * al.sum(-1, keepdim=True) / den).mean(0)[:, 0])
    return torch.cat(out, 1).transpose(0, 1).unsqueeze(0)


@torch.no_grad()
def attention_mass(m: LinearAttention, q, k, buckets, sinks: int = 4, rows: int = 512) -> str:
    """Mean share of the original softmax attention's weight on the last ``m.window`` tokens, on the first
    ``sinks`` tokens (once outside the window) and on the rest, per query-position bucket."""
    H, Hk = q.shape[2], k.shape[2]
    qh, kh = q[0].transpose(0, 1), k[0].transpose(0, 1).repeat_interleave(H // Hk, 0)  # [H, T, D]
    T = qh.shape[1]
    j = torch.arange(T)
    win, first = torch.zeros(T), torch.zeros(T)
    for a in range(0, T, rows):
        i = torch.arange(a, min(a + rows, T))
        diff = i[:, None] - j[None, :]
        p = ((qh[:, i] @ kh.transpose(1, 2)) * m.scaling).masked_fill(diff < 0, float("-inf")).softmax(-1)
        in_window = (diff >= 0) & (diff < m.window)
        win[i] = (p * in_window).sum(-1).mean(0)
        first[i] = (p[..., :sinks] * ~in_window[:, :sinks]).sum(-1).mean(0)
    return "  ".join(f"{a // 1024}-{z // 1024}K: window {win[a:z].mean():.3f} first-{sinks} {first[a:z].mean():.3f} "
                     f"rest {1 - win[a:z].mean() - first[a:z].mean():.3f}" for a, z in buckets)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="3", help="decoder layers, e.g. 3,11")
    ap.add_argument("--train-length", default="2K", help="row length; several (2K,8K) mix rows of each length")
    ap.add_argument("--rows", default="48", help="training rows (their inputs are kept in memory); one count per "
                                                 "--train-length")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps of one row each")
    ap.add_argument("--eval-length", default="16K", help="one held-out row of this length")
    ap.add_argument("--data", default="wiki", help="training text (a --data spec; mixtures too)")
    ap.add_argument("--eval-data", default="wiki", help="held-out corpora, one row each, e.g. wiki,books,code")
    ap.add_argument("--set", action="append", default=[], help="a lolcats attention setting, e.g. decay=learned")
    ap.add_argument("--sinks", type=int, default=0)
    ap.add_argument("--mass", action="store_true",
                    help="also print where the original attention's weight goes on the held-out row, by position")
    ap.add_argument("--cache", default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    layers = [int(x) for x in args.layers.split(",")]
    train_lens = [parse_length(x) for x in args.train_length.split(",")]
    row_counts = [int(x) for x in args.rows.split(",")]
    if len(row_counts) != len(train_lens):
        ap.error("--rows needs one count per --train-length")
    eval_len = parse_length(args.eval_length)
    settings = dict(LOLCATS, sinks=args.sinks)
    for item in args.set:
        key, value = item.split("=", 1)
        settings[key] = type(settings[key])(value) if key in settings else yaml.safe_load(value)
    model, tok = load_model("smollm2-135m", device="cpu")
    model.eval()

    def cached(name: str, make):
        path = (f"{args.cache}.{name}" if args.cache else
                os.path.join(tempfile.gettempdir(), f"layer_length_{args.layers}_{name}.pt".replace(":", "-")))
        if os.path.exists(path):
            return torch.load(path)
        t0 = time.time()
        got = make()
        torch.save(got, path)
        print(f"inputs captured in {time.time() - t0:.0f} s ({path})", flush=True)
        return got

    train = []
    for train_len, n_rows in zip(train_lens, row_counts):
        def rows_of(n=n_rows, length=train_len):
            rows = torch.cat(list(packed_batches(tok, args.data, seq_len=length, tokens=n * length, batch_size=1,
                                                 seed=0, copy_fraction=0.25)))  # [rows, length]
            return [capture(model, rows[i:i + 1], layers) for i in range(n)]
        name = f"{n_rows}x{train_len}" + ("" if args.data == "wiki" else f"_{args.data.replace(',', '+')}")
        train.append(cached(name, rows_of))
    held = {d: cached(f"heldout_{d}_{eval_len}",
                      lambda d=d: capture(model, heldout_sequences(tok, d, seq_len=eval_len, n_seqs=1), layers))
            for d in args.eval_data.split(",")}
    # several lengths: spread each part evenly over the fit order, so every stretch of steps sees each length
    train = [row for _, _, row in sorted((i / len(part), k, row) for k, part in enumerate(train)
                                         for i, row in enumerate(part))]
    buckets = [(a, min(max(2 * a, 2048), eval_len)) for a in (0, 2048, 4096, 8192, 16384) if a < eval_len]
    for L in layers:
        torch.manual_seed(0)
        m = LinearAttention(model.model.layers[L].self_attn, model.config, L, settings, arch_spec("llama"))
        @torch.no_grad()
        def teacher(rows):  # [(x, q, k, v, the original attention's output)]
            out = []
            for x, pe in rows:
                q, k, v = m.project(x, pe)
                out.append((x, q, k, v, m.softmax_attention(q, k, v)))
            return out

        fit = teacher([c[L] for c in train])
        evals = {d: teacher([h[L]])[0] for d, h in held.items()}
        if args.mass:
            for d, ev in evals.items():
                print(f"layer {L} {d}: original attention weight " + attention_mass(m, *ev[1:3], buckets), flush=True)

        def student(x, q, k, v):
            return m.linear_attention(q, k, v, log_decay=m.decay(x) if m.decay is not None else None)

        opt = torch.optim.AdamW(m.learned_parameters(), lr=1e-2, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 10) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / args.steps))))
        t0 = time.time()
        for step in range(args.steps):
            x, q, k, v, t = fit[step % len(fit)]
            loss = (student(x, q, k, v) - t).pow(2).mean() / t.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        secs = time.time() - t0
        for d, (x, q, k, v, t) in evals.items():
            with torch.no_grad():
                err = (student(x, q, k, v) - t).pow(2)[0].sum((1, 2))  # [T]
                ref = t.pow(2)[0].sum((1, 2))
                by_bucket = "  ".join(f"{a // 1024}-{z // 1024}K {err[a:z].sum() / ref[a:z].sum():.3f}"
                                      for a, z in buckets)
                line = (f"layer {L}{'' if list(evals) == ['wiki'] else ' ' + d}: normalized error {by_bucket} | "
                        f"window weight {torch.sigmoid(m.window_logit).mean():.2f}")
                if args.mass:  # the fitted layer's own split, to set beside the original's
                    share: list = []
                    quadratic(m, x, q, k, v, args.sinks, shares=share)
                    share = torch.cat(share)
                    line += " | linear part's share " + "  ".join(f"{a // 1024}-{z // 1024}K {share[a:z].mean():.3f}"
                                                               for a, z in buckets)
                if m.decay is not None:
                    half = (math.log(2) / (-m.decay(x)).clamp_min(1e-9)).median(dim=1).values[0]
                    line += " | half-life per KV head " + ", ".join(f"{h:,.0f}" for h in half.tolist())
            print(f"{line} | {args.steps} steps in {secs:.0f} s", flush=True)


if __name__ == "__main__":
    main()
