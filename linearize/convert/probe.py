"""The probe behind ``--select auto``: measure how much each layer suffers from linear attention.

1. Every layer is linearized with the recipe (the loaded model is wrapped in place; its original
   attention modules are put back afterwards, so the same model then goes through the real surgery).
2. A short attention transfer trains all layers at once with the stage-1 machinery
   (:func:`linearize.train.distill.distill`: the teacher output flows on, so layers are independent and one
   pass trains every one of them) on ``select.probe_fraction`` of the stage-1 token budget, with the
   data order of ``select.seed``.
3. Three measurements per layer ``i``, on held-out data:

   - ``mse_i``: the held-out normalized attention-output MSE ``|o_lin - o_soft|² / |o_soft|²`` after the
     probe's transfer (as in the stage-1 report);
   - ``loss_i = max(0, L_i - L_0)``: the held-out next-token loss (nats/token, ``distill.eval_seqs`` rows
     of ``distill.seq_len``) when *only* layer ``i`` runs linear attention and every other layer runs
     its original softmax attention (attention modes are switched; no model copies), minus the
     original model's loss ``L_0``;
   - ``retrieval_i = max(0, R_i - R_0)``: the same on the answer tokens of ``select.retrieval_prompts``
     passkey prompts of ``select.retrieval_length`` tokens (the key is hidden at evenly spaced depths;
     the loss is taken on the key's tokens after "The pass key is");
   - ``attention_i`` (only with ``select.attention_weight > 0``): the original model's attention weight
     from the last prompt position (the one that predicts the key) onto the key's tokens in the needle,
     the largest over layer ``i``'s heads, averaged over the same prompts. Single-layer ablation misses
     retrieval that several layers share (each one's loss increase stays small while the others still
     retrieve); this term sees every retrieving layer directly. Forward-only, on the teacher.

4. Each measurement becomes a share over layers and the score is their weighted mean::

       score_i = sum_t w_t * x_t(i) / sum_j x_t(j)  /  sum_t w_t      t in {mse, loss, retrieval, attention}

   with ``w_t`` = ``select.mse_weight``, ``select.loss_weight``, ``select.retrieval_weight``,
   ``select.attention_weight`` (a term with weight 0 is not measured, but for the seats' terms below; negative
   values, i.e. noise, count as 0; a term that is 0 for every layer drops out of both sums). Every term is
   scale-free and the scores sum to 1 over layers. The caller keeps as softmax the N layers with the highest scores
   (:func:`linearize.convert.selection.choose_softmax_layers`), after the seats: the
   ``ceil(select.retrieval_seats * N)`` layers with the largest ``attention_i`` are kept whatever their score and
   never swapped out, then the ``ceil(select.ablation_seats * N)`` others with the largest ``retrieval_i`` and the
   ``ceil(select.loss_seats * N)`` others with the largest ``loss_i`` the same way, while seats are left
   (:func:`linearize.convert.selection.choose_seats`; a seat's term is measured even when its weight is 0).

The trained feature maps (and window mixing logits) of the probe are returned too, so the real
conversion's linear layers start from them: the probe's tokens count as part of stage 1.

Results are cached under ``cache_root()/probes/KEY.json`` (plus ``KEY.safetensors`` with the trained
maps). KEY hashes what decides the measurements: the model weights' identity (resolved directory,
config.json hash, weight file names, sizes and mtimes), the recipe's ``attention`` section, its
``distill`` section (but for tokens, seed and checkpointing), the ``select`` fields that change a
measurement (not the score weights: scores are recomputed from cached measurements), the probe's
token budget, the data (spec + file sizes/mtimes) and tokenizer, dtype, device type and this module's
version. The same inputs never probe twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ..atomic import atomic_write
from ..data.packing import heldout_sequences
from ..data.specs import parse_spec
from ..data.tokens import source_fingerprint, tokenizer_fingerprint
from ..errors import SelectionError
from ..evals import passkey
from ..evals.common import EvalConfig, EvalError, parse_depths
from ..evals.prompts import PieceEncoder
from ..io.sources import cache_root, local_dir
from ..model.architectures import arch_spec
from ..model.layout import training_width
from ..train.distill import distill, evaluate_layers
from ..train.loop import training_window
from ..version import __version__
from .selection import LINEAR, SEAT_KINDS, choose_seats, rank_layers, seated, selection_boundary

#: bump when a measurement changes meaning (invalidates cached probes)
PROBE_VERSION = 2  # 2: retrieval prompts use seeds disjoint from `linearize eval`'s
# passkey seeds of `eval` are small integers (0, 1, ...); the probe's prompts live far from them so that a layout
# is never chosen on the very prompts it is later evaluated on
RETRIEVAL_SEED_OFFSET = 1_000_000
TERMS = ("mse", "loss", "retrieval", "attention")
SCORE_FORMULA = ("sum_t w_t * x_t(i) / sum_j x_t(j) / sum_t w_t over t in {mse: held-out attention MSE after the "
                 "probe, loss: held-out loss increase with only layer i linear, retrieval: passkey answer-loss "
                 "increase with only layer i linear, attention: the original's attention from the answer position "
                 "onto the pass key (max over heads)}")


@dataclass
class ProbeResult:
    """What the probe measured; ``scores()`` combines the measurements with the recipe's weights."""

    num_layers: int
    measurements: dict[str, list[float] | None]  # term -> per-layer value (None: not measured)
    baseline: dict[str, float | None]  # the original model's held-out and retrieval loss
    tokens: int  # attention-transfer tokens
    eval_tokens: int  # forward-only tokens spent on scoring
    seconds: float
    key: str | None = None
    cache_path: Path | None = None
    cached: bool = False
    maps: dict[str, torch.Tensor] = field(default_factory=dict)

    def scores(self, weights: dict[str, float]) -> list[float]:
        return combine_scores(self.measurements, weights)


def score_weights(recipe) -> dict[str, float]:
    """``{term: weight}`` from the recipe's ``select`` section; one line if every weight is 0."""
    sel = recipe["select"]
    w = {t: float(sel[f"{t}_weight"]) for t in TERMS}
    if not any(v > 0 for v in w.values()):
        raise SelectionError("recipe select: mse_weight, loss_weight, retrieval_weight and attention_weight are "
                             "all 0; set at least one > 0")
    return w


#: term -> the seat kind that needs it measured whatever its weight
SEAT_TERMS = {kind.term: kind.field for kind in SEAT_KINDS}


def measured_terms(recipe) -> list[str]:
    """The terms the probe measures, in :data:`TERMS` order: ``mse`` always, a term with a weight > 0, and the
    terms the seats need (:data:`SEAT_TERMS`)."""
    sel, weights = recipe["select"], score_weights(recipe)
    return [t for t in TERMS if t == "mse" or weights[t] > 0 or t in SEAT_TERMS and sel[SEAT_TERMS[t]] > 0]


def measures_retrieval(recipe) -> bool:
    """Whether the probe measures each layer's single-layer passkey loss rise (its score term or the ablation
    seats)."""
    return "retrieval" in measured_terms(recipe)


def combine_scores(measurements: dict[str, list[float] | None], weights: dict[str, float]) -> list[float]:
    """``score_i = sum_t w_t x_t(i) / sum_j x_t(j) / sum_t w_t`` (see the module docstring).

    Negative values (noise: linearizing a layer that happens to lower the loss) count as 0; a
    non-finite value counts as twice the largest finite one of its term; a term that is 0 for every layer
    drops out (its weight too), so the scores sum to 1 unless every term is 0.
    """
    present = {t: v for t, v in measurements.items() if v is not None and weights.get(t, 0.0) > 0}
    if not present:
        raise SelectionError("no probe measurement has a weight > 0 (select.*_weight)")
    n = len(next(iter(present.values())))
    total = [0.0] * n
    wsum = 0.0
    for t, values in present.items():
        finite = [v for v in values if math.isfinite(v)]
        worst = 2.0 * max(finite + [0.0]) or 1.0
        x = [max(0.0, v) if math.isfinite(v) else worst for v in values]
        s = sum(x)
        if s > 0:  # a term that hurts no layer carries no information (and no weight)
            wsum += weights[t]
            for i in range(n):
                total[i] += weights[t] * x[i] / s
    return [v / wsum for v in total] if wsum > 0 else total


def plan_probe_tokens(recipe, stage1_tokens: int) -> int:
    """The probe's attention-transfer budget: ``select.probe_fraction`` of the stage-1 budget, rounded
    down to whole optimizer steps of ``distill`` (seq_len x batch_size x grad_accum), at least one step."""
    d = recipe["distill"]
    step = d["seq_len"] * d["batch_size"] * d["grad_accum"]
    steps = max(1, int(recipe["select"]["probe_fraction"] * stage1_tokens) // step)
    return steps * step


def plan_scoring_tokens(recipe, num_layers: int, max_positions: int | None) -> int:
    """About how many forward-only tokens scoring the layers and the swap check cost, before any prompt is
    built: :func:`_measure`'s held-out and passkey passes with each layer alone linear and the original's
    attention onto the key, and :func:`swap_check`'s up to ``1 + rounds * pool**2`` joint layouts (prompts
    are counted at ``select.retrieval_length``; chat templates and answers add a few percent)."""
    sel, d = recipe["select"], recipe["distill"]
    measured = measured_terms(recipe)
    heldout = d["eval_seqs"] * d["seq_len"]
    length = min(sel["retrieval_length"], max_positions - 16) if max_positions else sel["retrieval_length"]
    retrieval = sel["retrieval_prompts"] * length
    tokens = heldout + (retrieval if "attention" in measured else 0)
    tokens += (num_layers + 1) * ((heldout if "loss" in measured else 0) + (retrieval if "retrieval" in measured else 0))
    if sel["swap_rounds"] > 0:
        tokens += (1 + sel["swap_rounds"] * sel["swap_pool"] ** 2) * (heldout + sel["retrieval_prompts"] * length)
    return int(tokens)


# ----------------------------------------------------------------------------------------------
# identity and cache


def weights_identity(path: Path) -> dict[str, Any]:
    """What identifies a model directory's weights without reading them: path, config hash, weight files'
    names, sizes and mtimes."""
    path = Path(path).resolve()
    cfg = path / "config.json"
    files = sorted(p for p in path.iterdir()
                   if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf"))
    return {"path": str(path),
            "config_sha256": hashlib.sha256(cfg.read_bytes()).hexdigest() if cfg.is_file() else None,
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def _model_identity(model) -> dict[str, Any] | None:
    source = getattr(model, "linearize_source", None)  # set by sources.load_model
    if source is None:
        return None

    return weights_identity(local_dir(source))


def cache_key(model, tokenizer, recipe, probe_tokens: int) -> tuple[str | None, dict[str, Any]]:
    """``(KEY, inputs)``; KEY is None when the model has no on-disk identity (not loaded from a spec)."""
    identity = _model_identity(model)
    data = recipe["distill"]["data"]
    src = parse_spec(data)
    sel = recipe["select"]
    param = next(model.parameters())
    inputs = {
        "probe_version": PROBE_VERSION, "linearize": __version__, "model": identity,
        "dtype": str(param.dtype).replace("torch.", ""), "device": param.device.type,
        "attention": dict(recipe["attention"]),
        "distill": {k: v for k, v in recipe["distill"].items() if k not in ("tokens", "seed", "checkpoint_every",
                                                                            "max_loss_ratio")},
        "select": {k: v for k, v in sel.items() if not k.endswith("_weight")
                   and k != "probe_fraction" and k not in SEAT_TERMS.values()},
        "measured": measured_terms(recipe),
        "probe_tokens": probe_tokens,
        "data": {"spec": data, **(source_fingerprint(src) if src.cacheable else {})},
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }
    if identity is None:
        return None, inputs
    blob = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20], inputs


def probes_dir() -> Path:
    return cache_root() / "probes"


def _save(result: ProbeResult, inputs: dict[str, Any]) -> None:
    base = probes_dir() / result.key
    if result.maps:  # the maps first: the JSON's presence means the entry is complete
        with atomic_write(base.with_suffix(".safetensors")) as tmp:
            save_file(result.maps, str(tmp))
    doc = {"key": result.key, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "num_layers": result.num_layers,
           "measurements": result.measurements, "baseline": result.baseline, "tokens": result.tokens,
           "eval_tokens": result.eval_tokens, "seconds": result.seconds, "maps": bool(result.maps), "inputs": inputs}
    with atomic_write(base.with_suffix(".json")) as tmp:
        tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    result.cache_path = base.with_suffix(".json")


def _load(key: str) -> ProbeResult | None:
    path = probes_dir() / f"{key}.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    maps = load_file(str(path.with_suffix(".safetensors"))) if doc["maps"] else {}
    return ProbeResult(num_layers=doc["num_layers"], measurements=doc["measurements"], baseline=doc["baseline"],
                       tokens=doc["tokens"], eval_tokens=doc["eval_tokens"], seconds=doc["seconds"], key=key,
                       cache_path=path, cached=True, maps=maps)


# ----------------------------------------------------------------------------------------------
# measurement


@contextlib.contextmanager
def all_linear(model, recipe):
    """Yield a hybrid of ``model`` with every layer linear, its windowed layers at the width training will use
    (``attention.train_window``); restore ``model``'s own attention modules (and its parameters'
    ``requires_grad``) on exit, so ``model`` can be converted again."""
    # start-up time: surgery imports transformers' model code; the plan imports this module before its checks
    from .surgery import check_supported, linearize_model

    check_supported(model)
    attr = arch_spec(model.config.model_type).attention
    layers = list(model.model.layers)
    originals = [getattr(layer, attr) for layer in layers]
    grads = [(p, p.requires_grad) for p in model.parameters()]
    try:
        hybrid = linearize_model(model, [LINEAR] * len(layers), recipe)
        with training_window(hybrid, training_width(recipe["attention"])):
            yield hybrid
    finally:
        for layer, orig in zip(layers, originals):
            setattr(layer, attr, orig)
        for p, g in grads:
            p.requires_grad_(g)


@torch.no_grad()
def _heldout_loss(model, ids: torch.Tensor, batch_size: int = 4) -> float:
    """Mean next-token cross-entropy (nats/token) over ``ids [N, T]``."""
    total, count = 0.0, 0
    for i in range(0, ids.shape[0], batch_size):
        batch = ids[i : i + batch_size].to(model.device)
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()  # [B, T-1, V]
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count


def retrieval_samples(tokenizer, recipe, max_positions: int | None) -> list[tuple[list[int], list[int], list[int]]]:
    """``(prompt ids, answer ids, key positions)`` passkey triples: the prompt ends in "The pass key is", the
    answer is the key, the positions are where the needle states the key's digits in the prompt."""
    sel = recipe["select"]
    length = sel["retrieval_length"]
    if max_positions:
        length = min(length, max_positions - 16)
    cfg = EvalConfig(lengths=[length], depths=parse_depths(sel["retrieval_prompts"]),
                     seeds=[RETRIEVAL_SEED_OFFSET + sel["seed"]])
    chat = bool(getattr(tokenizer, "chat_template", None))
    try:
        samples = passkey.build_prompts(tokenizer, chat, cfg)
    except EvalError as e:
        raise SelectionError(f"select.retrieval_length {length}: {e} (raise it, or set select.retrieval_weight=0)") from None
    return passkey_triples(tokenizer, samples)


def passkey_triples(tokenizer, prompts: list[dict]) -> list[tuple[list[int], list[int], list[int]]]:
    """``(prompt ids, answer ids, key positions)`` of prompts from :func:`passkey.build_prompts`."""
    enc = PieceEncoder(tokenizer)
    return [(s["ids"], passkey.answer_ids(enc, s["row"]["expected"][0]),
             key_positions(tokenizer, s["ids"], s["row"]["needle_pos"], s["row"]["expected"][0])) for s in prompts]


#: how far past the needle's start its key digits may sit (the needle is one short sentence pair)
NEEDLE_SPAN = 96


def key_positions(tokenizer, ids: list[int], needle_pos: int, key: str) -> list[int]:
    """Positions of the tokens that spell (part of) ``key``'s digits inside the needle starting at
    ``needle_pos`` (the filler holds no digits)."""
    out = []
    for i in range(needle_pos, min(len(ids), needle_pos + NEEDLE_SPAN)):
        piece = tokenizer.decode([ids[i]]).strip()
        if piece.isdigit() and piece in key:
            out.append(i)
    return out


@torch.no_grad()
def retrieval_attention(hybrid, samples) -> list[float]:
    """Per layer: the original attention's weight from the last prompt position onto the key positions, the
    largest over the layer's heads, averaged over ``samples`` (the hybrid runs its softmax mode)."""
    mods = hybrid.linear_modules()
    total = [0.0] * len(mods)
    current: dict[str, list[int]] = {}

    def hook(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        q, k, _ = module.project(hidden, kwargs.get("position_embeddings"))  # [B, T, H, D], [B, T, Hk, D]
        weights = module.teacher_logits(q[:, -1:], k)[:, :, 0].softmax(-1)  # [B, H, T]
        total[module.layer_idx] += weights[..., current["positions"]].sum(-1).amax(-1).mean().item()

    hybrid.set_attention_mode("softmax")
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in mods]
    try:
        for prompt, _, positions in samples:
            if not positions:
                raise SelectionError("probe: a retrieval prompt's needle holds no key digits the tokenizer "
                                     "keeps apart; set select.attention_weight=0 and "
                                     "select.retrieval_seats=0")
            current["positions"] = positions
            hybrid(input_ids=torch.tensor([prompt], device=hybrid.device), use_cache=False, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return [t / len(samples) for t in total]


@torch.no_grad()
def _retrieval_loss(model, samples: list[tuple[list[int], list[int], list[int]]]) -> float:
    """Mean cross-entropy on the answer tokens, each prompt followed by its answer."""
    total, count = 0.0, 0
    for prompt, answer, _ in samples:
        ids = torch.tensor([prompt + answer], device=model.device)
        n = len(answer)
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=n + 1).logits[0, :-1].float()  # [n, V]
        total += F.cross_entropy(logits, ids[0, -n:], reduction="sum").item()
        count += n
    return total / count


def _trained_state(hybrid) -> dict[str, torch.Tensor]:
    """``{"LAYER.param": tensor}`` of what stage 1 trains (the layers' ``learned_parameters``: learnable feature
    maps, window logits, decay gates), fp32 on the CPU."""
    out = {}
    for m in hybrid.linear_modules():
        learned = {id(p) for p in m.learned_parameters()}
        for name, p in m.named_parameters():
            if id(p) in learned:
                out[f"{m.layer_idx}.{name}"] = p.detach().float().cpu().contiguous()
    return out


def apply_feature_maps(hybrid, maps: dict[str, torch.Tensor]) -> list[int]:
    """Start ``hybrid``'s linear layers from the probe's trained maps; return the layers initialized.

    The values stay fp32, as stage 1 trains them."""
    done = []
    for m in hybrid.linear_modules():
        params = dict(m.named_parameters())
        prefix = f"{m.layer_idx}."
        hit = False
        for key, value in maps.items():
            if key.startswith(prefix) and key[len(prefix):] in params:
                p = params[key[len(prefix):]]
                if p.shape != value.shape:
                    raise SelectionError(f"probe maps do not fit layer {m.layer_idx} ({key}: {tuple(value.shape)} "
                                         f"vs {tuple(p.shape)}); remove {probes_dir()} and convert again")
                p.data = value.to(device=p.device, dtype=torch.float32).clone()
                hit = True
        if hit:
            done.append(m.layer_idx)
    return done


def _measure(model, tokenizer, recipe, probe_tokens: int, *, progress: bool, log: Callable[[str], None]) -> ProbeResult:
    sel, d = recipe["select"], recipe["distill"]
    t0 = time.time()
    n = model.config.num_hidden_layers
    torch.manual_seed(sel["seed"])
    with all_linear(model, recipe) as hybrid:
        log(f"probe: all {n} layers linear, attention transfer on {probe_tokens:,} tokens (seed {sel['seed']})")
        rep = distill(hybrid, tokenizer, recipe.with_overrides({"distill.seed": sel["seed"]}), state_dir=None,
                      tokens=probe_tokens, progress=progress, log=log)
        heldout = heldout_sequences(tokenizer, d["data"], seq_len=d["seq_len"], n_seqs=d["eval_seqs"])
        eval_tokens = heldout.numel() * (2 if "per_layer" in rep else 1)
        if "per_layer" in rep:
            mse = [r["normalized_end"] for r in rep["per_layer"]]
        else:
            mse = evaluate_layers(hybrid, heldout)["normalized_mse"]
        hybrid.eval()
        measurements: dict[str, list[float] | None] = {"mse": mse, "loss": None, "retrieval": None,
                                                       "attention": None}
        baseline: dict[str, float | None] = {"heldout_loss": None, "retrieval_loss": None}
        samples = []
        measured = measured_terms(recipe)
        if "retrieval" in measured or "attention" in measured:
            samples = retrieval_samples(tokenizer, recipe, getattr(model.config, "max_position_embeddings", None))
        if "attention" in measured:
            log(f"probe: the original's attention onto the pass key ({len(samples)} prompts)")
            measurements["attention"] = retrieval_attention(hybrid, samples)
            eval_tokens += sum(len(p) for p, _, _ in samples)
        passes = [("loss", "heldout_loss", lambda: _heldout_loss(hybrid, heldout), heldout.numel()),
                  ("retrieval", "retrieval_loss", lambda: _retrieval_loss(hybrid, samples),
                   sum(len(p) + len(a) for p, a, _ in samples))]
        for term, base_name, fn, tokens in passes:
            if term not in measured:
                continue
            log(f"probe: {term} with one linear layer at a time ({n + 1} passes of {tokens:,} tokens)")
            hybrid.set_attention_mode("softmax")
            base = fn()
            baseline[base_name] = base
            values = []
            for i in range(n):
                hybrid.set_softmax_layers(set(range(n)) - {i})  # only layer i linear
                values.append(fn() - base)
            measurements[term] = values
            eval_tokens += (n + 1) * tokens
        hybrid.set_attention_mode("linear")
        maps = _trained_state(hybrid)
    return ProbeResult(num_layers=n, measurements=measurements, baseline=baseline, tokens=int(rep.get("tokens", 0)),
                       eval_tokens=int(eval_tokens), seconds=round(time.time() - t0, 1), maps=maps)


#: a swap must lower the joint loss by more than this share to be kept (smaller differences are noise)
MIN_SWAP_GAIN = 0.01


def swap_check(model, tokenizer, recipe, result: ProbeResult, softmax: list[int], scores: list[float], *,
               reserved: list[int] = (), log: Callable[[str], None] = print) -> tuple[list[int], dict[str, Any]]:
    """Check the choice jointly on the probe's hybrid; ``(softmax layers, report)``.

    The scores rate layers one at a time; whether two layers are needed together only shows when they run
    together. Every layer of ``model`` is linearized with the probe's trained maps, the layers in the layout
    run softmax, and the layout's joint loss is the held-out next-token loss plus the passkey answer loss
    (nats/token each). Each of ``select.swap_rounds`` rounds tries every swap of one of the ``select.swap_pool``
    lowest-scoring kept layers for one of the ``swap_pool`` highest-scoring dropped ones and keeps the best if
    it lowers the joint loss by more than :data:`MIN_SWAP_GAIN`; a round without such a swap ends the check.
    ``reserved`` layers (the seats: :data:`linearize.convert.selection.SEAT_KINDS`) are never swapped out; with
    every layer a seat only the layout's joint loss is measured.
    """
    sel, d = recipe["select"], recipe["distill"]
    heldout = heldout_sequences(tokenizer, d["data"], seq_len=d["seq_len"], n_seqs=d["eval_seqs"])
    samples = retrieval_samples(tokenizer, recipe, getattr(model.config, "max_position_embeddings", None))
    t0 = time.time()
    seen: dict[frozenset, dict[str, float]] = {}
    with all_linear(model, recipe) as hybrid:
        apply_feature_maps(hybrid, result.maps)
        hybrid.eval()

        def joint(layout) -> float:
            key = frozenset(layout)
            if key not in seen:
                hybrid.set_softmax_layers(key)
                seen[key] = {"heldout_loss": _heldout_loss(hybrid, heldout),
                             "retrieval_loss": _retrieval_loss(hybrid, samples)}
            return seen[key]["heldout_loss"] + seen[key]["retrieval_loss"]

        current = sorted(softmax)
        start_layers = ",".join(map(str, current))
        start = best = joint(current)
        start_parts = seen[frozenset(current)]
        rounds = []
        for _ in range(sel["swap_rounds"]):
            kept = sorted((i for i in current if i not in reserved), key=lambda i: (scores[i], i))[: sel["swap_pool"]]
            if not kept:
                break
            dropped = [i for i in rank_layers(scores) if i not in current][: sel["swap_pool"]]
            trials = sorted((joint(set(current) - {k} | {a}), k, a) for k in kept for a in dropped)
            loss, k, a = trials[0]
            gain = (best - loss) / best if best > 0 else 0.0
            rounds.append({"drop": k, "add": a, "joint_loss": loss, "previous": best, "gain": gain,
                           "kept": gain > MIN_SWAP_GAIN, "tried": len(trials),
                           **seen[frozenset(set(current) - {k} | {a})]})
            if gain <= MIN_SWAP_GAIN:
                log(f"select: swap check: no swap lowers the joint loss {best:.4f} by more than "
                    f"{100 * MIN_SWAP_GAIN:.0f}% (best: layer {a} for {k}, {loss:.4f})")
                break
            log(f"select: swap check: layer {a} for {k} lowers the joint loss {best:.4f} -> {loss:.4f} "
                f"({100 * gain:.1f}%)")
            current, best = sorted(set(current) - {k} | {a}), loss
        hybrid.set_attention_mode("linear")
    report = {"rounds": rounds, "start_layers": start_layers,
              "final_layers": ",".join(map(str, current)), "start_joint_loss": start, "final_joint_loss": best,
              "start_heldout_loss": start_parts["heldout_loss"], "start_retrieval_loss": start_parts["retrieval_loss"],
              "layouts_evaluated": len(seen), "seconds": round(time.time() - t0, 1), "min_gain": MIN_SWAP_GAIN}
    return current, report


def run_probe(model, tokenizer, recipe, *, probe_tokens: int, use_cache: bool = True, progress: bool = True,
              log: Callable[[str], None] = print) -> ProbeResult:
    """Probe every layer of ``model`` (a loaded base causal LM, left as it was) or return the cached result."""
    key, inputs = cache_key(model, tokenizer, recipe, probe_tokens)
    if use_cache and key is not None:
        try:
            cached = _load(key)
        except Exception as e:  # noqa: BLE001 - a damaged entry is measured again
            log(f"probe: cache entry {key} is unreadable ({type(e).__name__}); probing again")
            cached = None
        if cached is not None:
            log(f"probe: cached {cached.cache_path} ({cached.tokens:,} tokens, {cached.seconds}s when measured); "
                f"not probing again")
            return cached
    elif key is None:
        log("probe: not cached (the model was not loaded from a spec, so its weights have no identity on disk)")
    result = _measure(model, tokenizer, recipe, probe_tokens, progress=progress, log=log)
    result.key = key
    if use_cache and key is not None:
        _save(result, inputs)
        log(f"probe: {result.tokens:,} tokens + {result.eval_tokens:,} scoring tokens in {result.seconds}s; "
            f"cached as {result.cache_path}")
    return result


def seats_for(result: ProbeResult, recipe, count: int) -> dict[str, list[int]]:
    """The seats of a ``count``-layer choice, ``{kind.field: layers}`` in
    :data:`linearize.convert.selection.SEAT_KINDS` order (:func:`linearize.convert.selection.choose_seats`)."""
    return choose_seats(result.measurements, count, recipe["select"])


def select_report(result: ProbeResult, recipe, softmax: list[int], *, count_from: str,
                  interleave: list[int] | None = None, total_tokens: int | None = None,
                  kv_budget: dict | None = None, initialized: list[int] | None = None,
                  swap_check: dict | None = None) -> dict[str, Any]:
    """The ``select`` stage report: scores, chosen layout and the probe's cost."""
    weights = score_weights(recipe)
    scores = result.scores(weights)
    by_kind = seats_for(result, recipe, len(softmax))
    seats = seated(by_kind)
    rank = {i: r + 1 for r, i in enumerate(rank_layers(scores))}
    rows = []
    for i in range(result.num_layers):
        m = {t: (result.measurements[t][i] if result.measurements.get(t) is not None else None) for t in TERMS}
        rows.append({"layer": i, "softmax": i in softmax, "seat": i in seats, "mse": m["mse"], "loss_delta": m["loss"],
                     "retrieval_delta": m["retrieval"], "retrieval_attention": m["attention"], "score": scores[i],
                     "rank": rank[i]})
    report = {
        "method": "auto", "softmax_count": len(softmax), "count_from": count_from,
        "softmax_layers": ",".join(map(str, softmax)),
        "interleave_softmax_layers": ",".join(map(str, interleave)) if interleave is not None else None,
        "probe_tokens": result.tokens, "probe_eval_tokens": result.eval_tokens, "probe_seconds": result.seconds,
        "total_tokens": total_tokens,
        "probe_share_of_total_tokens": (round(result.tokens / total_tokens, 4) if total_tokens else None),
        "probe_cached": result.cached, "probe_cache_key": result.key,
        "probe_initialized_layers": len(initialized or []),
        "baseline_heldout_loss": result.baseline.get("heldout_loss"),
        "baseline_retrieval_loss": result.baseline.get("retrieval_loss"),
        "scoring": {"formula": SCORE_FORMULA, "weights": weights}, "scores": rows,
        **{k: ",".join(map(str, got)) for k, got in by_kind.items()},
        "boundary": selection_boundary(scores, len(softmax), seats),
    }
    if kv_budget is not None:
        report["kv_budget"] = kv_budget
    if swap_check is not None:
        report["swap_check"] = swap_check
    return report
