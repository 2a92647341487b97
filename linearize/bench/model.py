"""Whole-model benchmark: ``linearize bench model``, a hybrid against its original, end to end.

For every context length ``T`` and batch size ``B`` each model gets one row:

* **prefill**: one forward over ``B x T`` random token ids with ``use_cache=True`` (logits of the
  last position only, as ``generate`` does), producing the cache. One untimed warm-up (kernel
  compilation, autotuning), then timed runs until about a second has been measured (at most 5, the
  median is kept); on CUDA once per SDPA backend (``--sdpa``, default flash and cuDNN through
  ``torch.nn.attention.sdpa_kernel``) and the fastest is kept and named in the row.
* **decode**: single-token steps at context ``T`` on the cache from the prefill. Softmax layers keep
  their prefill KV tensors in place and every step writes position ``T - 1`` (so each step attends
  to exactly ``T`` keys, the cost of a decode step at context ``T``, and nothing is reallocated);
  linear layers advance their recurrent state in place. On CUDA one step is captured in a CUDA
  graph and replayed ``--decode-steps`` times (``decode_mode: "cuda-graph"``); if capture fails the
  same step runs eagerly and the row says why (``decode_mode: "eager"``, ``decode_note``).
* **peak memory**: ``torch.cuda.max_memory_allocated`` over the row (weights included; reset per
  row); ``n/a`` on CPU.
* **cache bytes**: the sum of the tensors held by the cache after the prefill (KV of softmax layers,
  ``(S, z)`` and window rings of linear layers), beside the closed form of
  :func:`linearize.bench.costs.cache_bytes`.

Out of memory in a row is recorded as ``"oom"`` and the run goes on (larger rows that cannot fit
either are skipped). An original whose one-forward prefill runs out of memory is prefilled again in the
hybrids' default pieces (``PREFILL_CHUNK_TOKENS``, or ``--prefill-chunk``), so its decode is still measured
where its cache fits (the Llama-3-8B shape at 32K x 8 on an 80 GB GPU); the row's note says so.
``--random-weights`` builds the models from a published config shipped in
``linearize/model_configs/`` (or any ``config.json``): instantiated on the meta device, materialized
directly on the target device and initialized there in place, so no weights are downloaded and no
CPU copy is made.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import inspect
import json
import platform
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from rich.table import Table
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .. import recipe as recipes
from ..atomic import atomic_write
from ..convert.selection import describe_layout, parse_ratio, select_layout
from ..convert.surgery import linearize_model
from ..errors import LinearizeError, SpecError
from ..evals.common import parse_batch_sizes, parse_lengths
from ..io.aliases import ALIASES
from ..io.outputs import is_hybrid_dir
from ..io.sources import load_model, local_dir, read_config, resolve, resolve_dtype, shipped_configs, text_part
from ..model import modeling  # noqa: F401  (registers the linearize model type)
from ..model.architectures import arch_spec
from ..model.cache import HybridCache, LinearStateLayer
from ..model.prefill import PREFILL_CHUNK_TOKENS, check_chunk_size, chunked_forward, row_chunk
from ..progress import make_console
from ..settings import DEFAULT_RATIO, DEFAULT_RECIPE
from ..units import format_bytes
from ..version import __version__
from .costs import cache_bytes, cost_model, speedup_bounds

#: ``--sdpa`` names -> ``torch.nn.attention.SDPBackend`` member names
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}

RESULT_FILE = "bench_model.json"

#: the speed goals, checked when the rows they need exist: (what, metric, T, batch, bound)
TARGETS = (
    ("prefill tokens/s at 32K >= 1.8x the original", "prefill_speedup", 32768, 1, (">=", 1.8)),
    ("prefill tokens/s at 128K >= 3x the original", "prefill_speedup", 131072, 1, (">=", 3.0)),
    ("decode tokens/s at 32K, batch 8 >= 2.5x the original", "decode_speedup", 32768, 8, (">=", 2.5)),
    ("cache+state bytes at 128K <= 30% of the original", "cache_ratio", 131072, 1, ("<=", 0.30)),
)


# ---------------------------------------------------------------------------------------------
# configs and random models


def config_source(spec: str) -> tuple[Path, str]:
    """The config file a ``--random-weights`` spec names, and a short name for it.

    ``spec`` is an alias with a shipped config (``llama-3-8b``), the hub id such an alias stands for
    (``meta-llama/Meta-Llama-3-8B``, through ``sources.ALIASES``), a ``config.json`` path, or a directory
    holding one (a hybrid checkpoint's config works too).
    """
    p = Path(spec).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise SpecError(f"{spec}: directory has no config.json")
        return p / "config.json", p.resolve().name
    if p.suffix == ".json":
        if not p.is_file():
            raise SpecError(f"{spec}: config file not found")
        return p, p.stem if p.stem != "config" else p.resolve().parent.name
    configs = shipped_configs()
    alias = spec if spec in ALIASES else {hub: a for a, hub in ALIASES.items()}.get(spec, spec)
    if alias not in configs:
        raise SpecError(f"--random-weights {spec!r}: no shipped config for it (shipped: {', '.join(configs)}); "
                        f"pass the path of a config.json instead")
    return configs[alias], alias


def load_config(spec: str):
    """``(config, name)`` for a ``--random-weights`` spec (see :func:`config_source`)."""
    path, name = config_source(spec)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SpecError(f"{path}: not a readable JSON config ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise SpecError(f"{path}: no model_type (not a Hugging Face config.json)")
    model_type = raw.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError, TypeError) as e:
        raise SpecError(f"{path}: cannot build a config of model_type {model_type!r} "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None
    return text_part(config), name  # a vision-language config: its text decoder's


#: non-persistent buffer -> the attribute holding its value as a Python number (rebuilt after meta init)
SCALAR_BUFFERS = {"embed_scale": "scalar_embed_scale"}


@torch.no_grad()
def materialize_random_(model: torch.nn.Module, device, *, seed: int = 0) -> torch.nn.Module:
    """Allocate a meta-device model on ``device`` and initialize it there, in place.

    Norm weights are 1, biases 0, every other parameter ``N(0, initializer_range)``; non-persistent
    buffers (rotary inverse frequencies, which were never computed on meta) are rebuilt by
    re-creating their modules. Raises if a buffer is left that cannot be recomputed.
    """
    device = torch.device(device)
    model.to_empty(device=device)
    std = float(getattr(model.config, "initializer_range", None) or 0.02)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    done: set[int] = set()
    for module in model.modules():
        is_norm = "norm" in type(module).__name__.lower()
        for name, p in module.named_parameters(recurse=False):
            if id(p) in done:
                continue
            done.add(id(p))
            if is_norm:
                p.fill_(1.0 if name == "weight" else 0.0)
            elif name == "bias":
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)
    rebuilt: set[int] = set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RotaryEmbedding"):
                fresh = type(child)(config=child.config).to(device)
                setattr(parent, name, fresh)
                rebuilt.add(id(fresh))
    for module in model.modules():  # buffers that hold a scalar the module also keeps (Gemma 3's embedding scale)
        held = {b: getattr(module, src) for b, src in SCALAR_BUFFERS.items()
                if module._buffers.get(b) is not None and isinstance(getattr(module, src, None), (int, float))}
        for b, value in held.items():
            module._buffers[b] = torch.tensor(float(value), device=device)
        if held and all(b in held for b, t in module._buffers.items() if t is not None):
            rebuilt.add(id(module))
    for mname, module in model.named_modules():
        if id(module) not in rebuilt and any(b is not None for b in module._buffers.values()):
            raise RuntimeError(f"random init: cannot initialize the buffers of {mname or 'the model'} "
                               f"({type(module).__name__}) created on the meta device")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model


def random_model(config, *, dtype: torch.dtype, device, seed: int = 0):
    """A causal LM of ``config`` with random weights, built on meta and materialized on ``device``."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    materialize_random_(model, device, seed=seed)
    return model.eval()


# ---------------------------------------------------------------------------------------------
# small helpers


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _now(dev: torch.device) -> float:
    _sync(dev)
    return time.perf_counter()


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in str(e).lower()


def _first_line(e: BaseException, n: int = 200) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text[:n]}"


def _free(dev: torch.device) -> None:
    """Collect garbage and return cached blocks; on CUDA also drop cuBLAS's per-stream workspaces (allocated through
    PyTorch's allocator, so counted as allocated memory, and kept until cleared): without this a row started with the
    workspaces of the rows before it (an H200 run of 2026-12-02 had 0.16 GiB more allocated before the hybrid's
    Gemma-3-1B row than before the original's, 6 MiB of it the hybrid's own weights)."""
    gc.collect()
    if dev.type == "cuda":
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # what PyTorch's own leak check calls
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


_SIDE_STREAMS: dict[torch.device, Any] = {}


def _side_stream(dev: torch.device):
    """One side stream per device for warm-up and capture: each new stream gets its own cuBLAS workspace."""
    if dev not in _SIDE_STREAMS:
        _SIDE_STREAMS[dev] = torch.cuda.Stream(dev)
    return _SIDE_STREAMS[dev]


def _sdpa(name: str | None):
    """``sdpa_kernel`` restricted to one backend (``None``: PyTorch's own choice)."""
    if name is None:
        return contextlib.nullcontext()

    return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[name]))


#: an attention implementation for the decode timing: transformers' SDPA forward, registered under a name that
#: has no mask function, so no mask is built (every decode step attends to all T slots of the fixed-slot cache)
MASKLESS_SDPA = "linearize_sdpa_maskless"


def _maskless_sdpa(model):
    """Run ``model``'s SDPA layers without an attention mask for the duration of the context.

    transformers builds a boolean mask whenever a CUDA stream is capturing (it cannot read the padding mask
    to prove one unnecessary), and flash attention refuses masks: on the H200 every decode capture failed
    with "No available kernel" (2026-12-01). Each decode step attends to every slot of the fixed-slot cache,
    so the mask is all True; without it SDPA computes the same step, captured or eager.
    """
    AttentionInterface.register(MASKLESS_SDPA, sdpa_attention_forward)
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "_attn_implementation", None) == "sdpa"}

    @contextlib.contextmanager
    def swap():
        for c in configs.values():
            c._attn_implementation = MASKLESS_SDPA
        try:
            yield
        finally:
            for c in configs.values():
                c._attn_implementation = "sdpa"

    return swap()


def _forward_params(model) -> set[str]:
    fn = getattr(model, "_base_forward", None) or type(model).forward
    return set(inspect.signature(inspect.unwrap(fn)).parameters)


def _cache_kwargs(model, cache) -> dict:
    params = set(inspect.signature(inspect.unwrap(type(model).forward)).parameters)
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def new_cache(model):
    """An empty generation cache for ``model`` (a HybridCache for hybrids)."""
    if hasattr(model, "new_cache"):
        return model.new_cache()

    return DynamicCache(config=model.config)


def cache_nbytes(cache) -> int:
    """Bytes held by the tensors of a cache (each tensor counted once)."""
    total, seen = 0, set()
    for layer in cache.layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        state = getattr(layer, "state", None)
        if state is not None:  # a tuple or NamedTuple of tensors; one tensor for a gated delta layer
            tensors.extend([state] if torch.is_tensor(state) else state)
        for t in tensors:
            if torch.is_tensor(t) and t.numel() and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def _fixed_slot_layer_class():
    class FixedSlotKVLayer(CacheLayerMixin):
        """A softmax layer's prefill KV used in place for decode timing: every step writes slot
        ``T - 1`` and attends to all ``T`` slots (fixed shapes and addresses: CUDA-graph safe). A sliding layer
        (``offset`` > 0) holds its window: the slots are positions ``offset ..``, the last one rewritten."""

        is_compileable = False  # keeps transformers' "no mask needed for one query" shortcut

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor, offset: int = 0):
            super().__init__()
            self.keys, self.values, self.slot, self.offset = keys, values, slot, offset
            self.is_sliding = offset > 0
            self.device = keys.device
            self.is_initialized = True

        def lazy_initialization(self, key_states=None, value_states=None) -> None:
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            self.keys.index_copy_(2, self.slot, key_states)
            self.values.index_copy_(2, self.slot, value_states)
            return self.keys, self.values

        def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
            return self.keys.shape[2], self.offset

        def get_seq_length(self, *args) -> int:
            return self.offset + self.keys.shape[2] - 1

        def get_max_length(self) -> int:
            return self.keys.shape[2]

        def reset(self) -> None:
            self.keys.zero_()
            self.values.zero_()

        def reorder_cache(self, beam_idx) -> None:
            raise NotImplementedError("the decode-timing cache does not support beam search")

        def offload(self):  # stays on the device: its addresses are captured in a CUDA graph
            pass

        def prefetch(self):
            pass

    return FixedSlotKVLayer


def decode_cache(cache, seq_len: int):
    """The prefill cache rearranged for fixed-shape decode steps at position ``seq_len - 1``.

    Softmax layers wrap their prefill KV tensors (no copy; a sliding layer past its window, which keeps the last
    ``W - 1`` tokens, gets one more slot so that a step attends to ``W`` keys); linear-attention layers are kept
    as they are (their state is updated in place). Returns a cache of the same family (HybridCache for hybrids).
    """
    layer_cls = _fixed_slot_layer_class()
    layers = []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearStateLayer):
            layers.append(layer)
        elif type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) and torch.is_tensor(layer.keys) and \
                layer.keys.shape[2] == seq_len:
            slot = torch.tensor([seq_len - 1], dtype=torch.long, device=layer.keys.device)
            layers.append(layer_cls(layer.keys, layer.values, slot))
        elif type(layer) is DynamicSlidingWindowLayer and torch.is_tensor(layer.keys) and \
                layer.keys.shape[2] == layer.sliding_window - 1 < seq_len:
            w = layer.sliding_window
            keys, values = (torch.cat([t, t[:, :, -1:]], dim=2) for t in (layer.keys, layer.values))
            slot = torch.tensor([w - 1], dtype=torch.long, device=keys.device)
            layers.append(layer_cls(keys, values, slot, offset=seq_len - w))
        else:
            raise RuntimeError(f"decode timing needs the prefill's KV in every softmax layer (all {seq_len} tokens, "
                               f"or a sliding window's); layer {i} holds a {type(layer).__name__}")
    if isinstance(cache, HybridCache):
        out = HybridCache(cache.layer_types, cache.windows)
        out.layers = layers
        return out
    return Cache(layers=layers)


# ---------------------------------------------------------------------------------------------
# timing


@dataclass
class Timing:
    """How long to measure: until ``min_time`` seconds or ``max_reps`` runs (median kept)."""

    min_time: float = 1.0
    max_reps: int = 5
    warmup_steps: int = 3


@torch.no_grad()
def prefill(model, ids: torch.Tensor, pieces: int = 0):
    """One forward over ``ids`` with a fresh cache; returns the filled cache. ``pieces`` > 0: consecutive cached
    forwards of ``pieces`` tokens (the rows together), as a hybrid's chunked prefill runs, when ``ids`` is longer."""
    cache = new_cache(model)
    kwargs = _cache_kwargs(model, cache)
    chunk = row_chunk(pieces, ids.shape[0])
    if chunk and ids.shape[1] > chunk:
        chunked_forward(lambda **piece: model(use_cache=True, **kwargs, **piece), chunk, input_ids=ids,
                        inputs_embeds=None, attention_mask=None, position_ids=None, past=0, logits_to_keep=1,
                        return_cache=False)
    else:
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs)
    return cache


def _try_backends(backends: list[str | None], run: Callable[[str | None], Any]) -> tuple[str | None, dict, dict]:
    """Run ``run(backend)`` for each backend; a backend that fails (other than out of memory) is recorded
    and skipped; if all fail, PyTorch's own choice (``None``) is tried last."""
    results, errors = {}, {}
    for be in backends:
        try:
            results[be] = run(be)
        except Exception as e:  # noqa: BLE001 - a backend that cannot run this shape
            if _is_oom(e):
                raise
            errors[be] = _first_line(e)
    if not results and None not in backends:
        try:
            results[None] = run(None)
        except Exception as e:  # noqa: BLE001
            if _is_oom(e):
                raise
            errors["default"] = _first_line(e)
    if not results:
        raise RuntimeError("no SDPA backend could run: " + "; ".join(f"{k}: {v}" for k, v in errors.items()))
    return results, errors


#: rows of at least this many tokens (B x T) warm up on a prefix of :data:`WARMUP_PREFIX` tokens per sequence
#: instead of a whole prefill (minutes at 1M tokens; the kernels it compiles are the same: a chunked prefill's
#: pieces keep one shape, and flash attention is not tuned per length)
LONG_ROW_TOKENS = 1 << 20
WARMUP_PREFIX = 16384


def warmup_ids(ids: torch.Tensor) -> torch.Tensor:
    """The input of a row's untimed warm-up: all of ``ids``, or its first :data:`WARMUP_PREFIX` tokens per
    sequence for a row of :data:`LONG_ROW_TOKENS` or more."""
    return ids[:, :WARMUP_PREFIX] if ids.numel() >= LONG_ROW_TOKENS else ids


def _prefill_phase(model, ids, backends, dev, timing: Timing, holder: dict, pieces: int = 0) -> dict:
    warmed = []

    def run(be):
        with _sdpa(be):
            if not warmed:  # compile / autotune kernels for this shape once
                holder["cache"] = None
                holder["cache"] = prefill(model, warmup_ids(ids), pieces)
                warmed.append(be)
            times = []
            while True:
                holder["cache"] = None
                t0 = _now(dev)
                holder["cache"] = prefill(model, ids, pieces)
                times.append(_now(dev) - t0)
                if len(times) >= timing.max_reps or sum(times) >= timing.min_time:
                    break
            return statistics.median(times)

    results, errors = _try_backends(backends, run)
    best = min(results, key=results.get)
    if holder["cache"] is None:  # the last backend tried failed after an earlier one succeeded
        with _sdpa(best):
            holder["cache"] = prefill(model, ids, pieces)
    B, T = ids.shape
    return {"prefill_s": round(results[best], 6), "prefill_tok_s": round(B * T / results[best], 2),
            "prefill_warmup_tokens": warmup_ids(ids).shape[1], "prefill_sdpa": best or "default",
            "prefill_sdpa_s": {(k or "default"): round(v, 6) for k, v in results.items()} | errors}


def _time_steps(step: Callable[[], Any], steps: int, dev: torch.device, timing: Timing,
                profile: bool = False) -> tuple[float, str, str | None, dict | None]:
    """``(seconds per step, mode, note, profile)`` of decode steps: a captured CUDA graph replayed ``steps``
    times, or eager steps. ``profile``: also :func:`profile_steps` of what was timed (the graph's replays, or
    the eager steps), else None.

    An error in the warm-up (e.g. an SDPA backend that cannot run this shape) propagates; an error in the
    capture falls back to eager steps with a note saying why.
    """
    def timed(run: Callable[[], Any], mode: str, note: str | None):
        t0 = _now(dev)
        for _ in range(steps):
            run()
        return (_now(dev) - t0) / steps, mode, note, (_profile_or_error(run, dev) if profile else None)

    if dev.type != "cuda":
        for _ in range(timing.warmup_steps):
            step()
        return timed(step, "eager", "CPU: eager steps (CUDA graphs need a GPU)")
    side = _side_stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires (compilation, allocator)
        for _ in range(timing.warmup_steps):
            step()
    torch.cuda.current_stream(dev).wait_stream(side)
    _sync(dev)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        return timed(graph.replay, "cuda-graph", None)
    except Exception as e:  # noqa: BLE001 - fall back to eager steps, say why
        if _is_oom(e):
            raise
        note = f"CUDA graph capture failed ({_first_line(e, 160)}); eager steps"
    finally:
        del graph
    _sync(dev)
    step()
    return timed(step, "eager", note)


#: where a decode step's time goes, by kernel (GPU) or operator (CPU) name, first match wins; the rest is "other"
PROFILE_CATEGORIES = (
    # our Triton kernels (on CPU the layers' PyTorch path shows as generic operators)
    ("linear attention", re.compile(r"_la_|_win_|_window_step|_linear_step|_hedgehog_map|_scan_kernel|_row_stats|_rotary_kernel")),
    ("softmax attention", re.compile(r"attention|flash|fmha|sdpa|scaled_dot_product")),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|splitkreduce|aten::(mm|addmm|bmm|baddbmm)$")),
)


PROFILE_TOP_OTHER = 8  # the largest uncategorised kernels listed by name, to show what "other" is made of
_SPECIFIC = re.compile(r"\w*(?:Functor|Ops|_kernel_cuda|_kernel_impl|BatchedCopy)\w*")


def kernel_label(name: str) -> str:
    """A short name for a profiler key: the innermost functor or op in an ATen kernel's template (``MulFunctor``,
    ``MeanOps``, ``neg_kernel_cuda``), else the name without return type, template and arguments."""
    hits = [h for h in _SPECIFIC.findall(name) if not h.startswith("gpu_kernel_impl")]
    if hits:
        return hits[-1]
    if "<" not in name and "(" not in name:
        return name
    return re.sub(r"^void\s+", "", name).split("<")[0].split("(")[0].strip().rsplit("::", 1)[-1] or name[:60]


def profile_steps(step: Callable[[], Any], dev: torch.device, steps: int = 3) -> dict:
    """Milliseconds per decode step by :data:`PROFILE_CATEGORIES` (and ``other``, ``total``) over ``steps`` calls
    of ``step`` (an eager step or a CUDA graph's replay) under ``torch.profiler``: GPU kernel time on CUDA,
    operators' own CPU time on CPU; ``other_top``: the largest parts of ``other`` as ``[kernel_label, ms]`` pairs."""
    cuda = dev.type == "cuda"
    step()
    _sync(dev)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
        _sync(dev)
    out = {name: 0.0 for name, _ in PROFILE_CATEGORIES} | {"other": 0.0}
    other: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", 0.0) if cuda else ev.self_cpu_time_total
        if not us:
            continue
        cat = next((c for c, pattern in PROFILE_CATEGORIES if pattern.search(ev.key.lower())), "other")
        out[cat] += us / 1e3 / steps
        if cat == "other":
            label = kernel_label(ev.key)
            other[label] = other.get(label, 0.0) + us / 1e3 / steps
    out["total"] = sum(out.values())
    top = sorted(other.items(), key=lambda kv: -kv[1])[:PROFILE_TOP_OTHER]
    return {k: round(v, 4) for k, v in out.items()} | {"other_top": [[k, round(v, 4)] for k, v in top]}


def _profile_or_error(step: Callable[[], Any], dev: torch.device) -> dict:
    """:func:`profile_steps`, or ``{"error": first line}`` when profiling fails (the timings stand)."""
    try:
        return profile_steps(step, dev)
    except Exception as e:  # noqa: BLE001
        if _is_oom(e):
            raise
        return {"error": _first_line(e, 200)}


@torch.no_grad()
def _decode_phase(model, cache, T, B, steps, backends, dev, timing: Timing, gen, profile: bool = False) -> dict:
    dcache = decode_cache(cache, T)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (B, 1), generator=gen).to(dev)
    kwargs = dict(input_ids=ids, position_ids=torch.full((B, 1), T - 1, dtype=torch.long, device=dev),
                  use_cache=True, logits_to_keep=1, **_cache_kwargs(model, dcache))
    if "cache_position" in _forward_params(model):  # older transformers take explicit cache positions
        kwargs["cache_position"] = torch.tensor([T - 1], dtype=torch.long, device=dev)

    def step():
        return model(**kwargs).logits

    modes: dict[str | None, tuple[str, str | None, dict | None]] = {}

    def run(be):
        with _sdpa(be), _maskless_sdpa(model):
            s, mode, note, prof = _time_steps(step, steps, dev, timing, profile)
        modes[be] = (mode, note, prof)
        return s

    # capture can fail under one pinned backend (H200 run of 2026-11-30: "No available kernel" from SDPA inside
    # the capture) and still succeed with PyTorch's own per-call choice, so on CUDA that choice always competes
    tried = list(backends) + ([None] if dev.type == "cuda" and None not in backends else [])
    results, errors = _try_backends(tried, run)
    best = min(results, key=results.get)
    mode, note, prof = modes[best]
    row = {"decode_s_per_step": round(results[best], 7), "decode_tok_s": round(B / results[best], 2),
           "decode_mode": mode, "decode_sdpa": best or "default",
           "decode_sdpa_s": {(k or "default"): round(v, 7) for k, v in results.items()} | errors,
           # each backend's mode, and why capture failed where it did (the row's note is the fastest one's)
           "decode_modes": {(k or "default"): (n or m) for k, (m, n, _) in modes.items()}}
    if note:
        row["decode_note"] = note
    if prof is not None:  # of the fastest backend's timed steps, in their mode (a failing profile: the error)
        if "error" in prof:
            row["decode_profile_error"] = prof["error"]
        else:
            row["decode_profile_other_top"] = prof.pop("other_top")
            row["decode_profile_ms"] = prof
    return row


#: the smallest pieces (tokens per row) an original's prefill is retried in after running out of memory
MIN_PIECE_ROW_TOKENS = 512


def bench_row(model, kind: str, T: int, B: int, *, steps: int, backends: list[str | None], dev: torch.device,
              timing: Timing, seed: int = 0, profile: bool = False, pieces: int = 0) -> dict:
    """One (model, T, B) row: prefill, decode, peak memory, cache bytes. Out of memory is recorded. ``pieces`` > 0
    (a model without a chunked prefill of its own, the original): a prefill that runs out of memory in one forward
    runs again as consecutive cached forwards of ``pieces`` tokens, the rows together (the hybrids' default
    pieces), halved while those run out of memory too (down to :data:`MIN_PIECE_ROW_TOKENS` per row), so that its
    decode is still measured; the row says so in ``prefill_pieces_tokens`` and its note."""
    row: dict[str, Any] = {"model": kind, "T": T, "B": B, "status": "ok"}
    _free(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        row["allocated_before_bytes"] = torch.cuda.memory_allocated(dev)  # weights + anything resident
    gen = torch.Generator().manual_seed(seed * 1_000_003 + T * 17 + B)
    holder: dict[str, Any] = {"cache": None}
    phase = "prefill"
    try:
        ids = torch.randint(0, int(model.config.vocab_size), (B, T), generator=gen).to(dev)
        tried = 0  # 0: one forward, then pieces of `pieces` tokens, halved while they run out of memory
        while True:
            try:
                row.update(_prefill_phase(model, ids, backends, dev, timing, holder, tried))
                break
            except Exception as e:  # noqa: BLE001 - out of memory: in (smaller) pieces, if asked
                nxt = pieces if not tried else tried // 2
                floor = MIN_PIECE_ROW_TOKENS if tried else 1  # the pieces asked for are tried whatever their size
                if not (_is_oom(e) and row_chunk(nxt, B) >= floor and T > row_chunk(nxt, B)):
                    raise
                del e  # its traceback holds the failed forward's activations
                holder["cache"] = None
                _free(dev)
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                tried = nxt
        if tried:
            row["prefill_pieces_tokens"] = tried
            row["note"] = (f"prefilled in pieces of {tried:,} tokens (the rows together)"
                           + (", as the hybrids' default" if tried == pieces else
                              f", halved from the hybrids' {pieces:,}") + "; one forward ran out of memory")
        del ids
        row["cache_bytes"] = cache_nbytes(holder["cache"])
        row["cache_bytes_formula"] = model_cache_bytes(model, T, B)
        phase = "decode"
        row.update(_decode_phase(model, holder["cache"], T, B, steps, backends, dev, timing, gen, profile))
    except Exception as e:  # noqa: BLE001 - one row's failure must not end the run
        if _is_oom(e):
            row["status"] = "oom"
            row["oom_phase"] = phase
            if phase == "prefill":
                row["prefill_tok_s"] = "oom"
            row["decode_tok_s"] = "oom"
        else:
            row["status"] = "error"
            row["error"] = f"{phase}: {_first_line(e, 300)}"
    holder["cache"] = None
    if dev.type == "cuda":
        row["peak_bytes"] = "oom" if row["status"] == "oom" else torch.cuda.max_memory_allocated(dev)
    else:
        row["peak_bytes"] = "n/a"
    _free(dev)
    return row


# ---------------------------------------------------------------------------------------------
# what is compared with what


@dataclass
class Pair:
    """How to build the original and the hybrid (the hybrid may be made in place from the original)."""

    original_name: str
    hybrid_name: str
    build_original: Callable[[], Any]
    build_hybrid: Callable[[Any], Any]  # receives the original (or None once it was freed)
    hybrid_from_original: bool
    layer_types: list[str] | None
    notes: list[str] = field(default_factory=list)
    layout_from_checkpoint: bool = False  # layout and layer settings come from a hybrid's config, not --ratio/--recipe


def _surgery(model, layer_types, attention: dict):
    return linearize_model(model, layer_types, {"attention": dict(attention)})


def _raise_positions(config, max_len: int, notes: list[str], name: str) -> None:
    cur = getattr(config, "max_position_embeddings", None)
    if cur is not None and cur < max_len:
        config.max_position_embeddings = max_len
        notes.append(f"{name}: max_position_embeddings raised from {cur} to {max_len} for the longest length")


def plan_pair(spec: str, *, against: str | None, random_weights: bool, ratio: str, recipe, dtype, device,
              max_len: int) -> Pair:
    """Resolve what to compare without loading any weights (every user error surfaces here)."""
    if random_weights:
        cfg, name = load_config(spec)
        notes: list[str] = []
        if cfg.model_type == "linearize":
            base_cfg, layer_types, attention = cfg.base_config(), list(cfg.layer_types), dict(cfg.linear_attention)
            notes.append(f"layout and linear-attention settings from {name}'s config")
        else:
            base_cfg, attention = cfg, dict(recipe["attention"])
            layer_types = select_layout(cfg.num_hidden_layers, ratio=ratio)
        arch_spec(base_cfg.model_type)
        _raise_positions(base_cfg, max_len, notes, name)
        if against is not None:
            orig_cfg, orig_name = load_config(against)
            if orig_cfg.model_type == "linearize":
                raise SpecError(f"--against {against!r}: that is a hybrid; give the softmax original")
            _raise_positions(orig_cfg, max_len, notes, orig_name)
        else:
            orig_cfg, orig_name = base_cfg, name
        reuse = against is None
        return Pair(
            original_name=f"{orig_name} (random weights)", hybrid_name=f"{name} hybrid (random weights, untrained)",
            build_original=lambda: random_model(orig_cfg, dtype=dtype, device=device),
            build_hybrid=lambda orig: _surgery(orig if reuse else random_model(base_cfg, dtype=dtype, device=device, seed=1),
                                               layer_types, attention),
            hybrid_from_original=reuse, layer_types=layer_types, notes=notes,
            layout_from_checkpoint=cfg.model_type == "linearize")

    r = resolve(spec)
    path = local_dir(r)
    if is_hybrid_dir(path):
        base = against
        if base is None:
            try:
                base = json.loads((Path(path) / "report.json").read_text())["base_model"]
            except (OSError, ValueError, KeyError):
                raise SpecError(f"{spec}: the checkpoint does not name its base model (report.json); "
                                f"pass --against SPEC") from None
        try:
            resolve(base)
        except SpecError as e:
            raise SpecError(f"{spec}: its original {base!r} cannot be loaded ({e}); pass --against SPEC") from None
        layer_types = list(read_config(path).layer_types)
        return Pair(original_name=base, hybrid_name=r.name,
                    build_original=lambda: load_model(base, dtype=dtype, device=device)[0],
                    build_hybrid=lambda orig: load_model(str(path), dtype=dtype, device=device)[0],
                    hybrid_from_original=False, layer_types=layer_types, layout_from_checkpoint=True)
    cfg = read_config(path)  # a vision-language model: its text decoder
    if getattr(cfg, "model_type", None) == "linearize":
        raise SpecError(f"{spec}: a hybrid config without a checkpoint")
    arch_spec(cfg.model_type)
    layer_types = select_layout(cfg.num_hidden_layers, ratio=ratio)
    attention = dict(recipe["attention"])
    if against is not None:
        resolve(against)
    reuse = against is None
    orig_spec = spec if reuse else against
    return Pair(original_name=resolve(orig_spec).name, hybrid_name=f"{r.name} hybrid (surgery only, untrained)",
                build_original=lambda: load_model(orig_spec, dtype=dtype, device=device)[0],
                build_hybrid=lambda orig: _surgery(orig if reuse else load_model(spec, dtype=dtype, device=device)[0],
                                                   layer_types, attention),
                hybrid_from_original=reuse, layer_types=layer_types)


# ---------------------------------------------------------------------------------------------
# the run


def parse_sdpa(value: str) -> list[str]:
    """``"flash,cudnn"`` -> ``["flash", "cudnn"]``; names from :data:`SDPA_BACKENDS`."""
    names = [v.strip() for v in str(value).split(",") if v.strip()]
    bad = [n for n in names if n not in SDPA_BACKENDS]
    if not names or bad:
        raise LinearizeError(f"--sdpa {value!r}: expected a comma list of {', '.join(SDPA_BACKENDS)}")
    return list(dict.fromkeys(names))


def _versions() -> dict[str, str]:
    out = {"linearize": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version()}
    try:
        # optional: Triton, absent on a CPU-only install
        import triton

        out["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - triton is optional off Linux
        out["triton"] = "absent"
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["cuda"] = str(torch.version.cuda)
    return out


def ratios(rows: list[dict]) -> list[dict]:
    """Hybrid / original per (T, B): speed-ups (> 1 = hybrid faster), memory fractions, and the speed-ups the
    hybrid's shapes allow at the original's efficiency (``prefill_bound``: FLOPs per token; ``decode_bound``:
    bytes a decode step reads, weights + cache), from each row's ``cost``. One entry per hybrid (``model``: the
    hybrid's row name, ``hybrid`` or ``hybrid A:B`` when several layouts were measured) and (T, B)."""
    by = {(r["model"], r["T"], r["B"]): r for r in rows}
    keys = sorted({(r["T"], r["B"]) for r in rows})
    hybrids = list(dict.fromkeys(r["model"] for r in rows if r["model"] != "original"))
    out = []

    def frac(h, o, key):
        a, b = h.get(key), o.get(key)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b:
            return float(f"{a / b:.5g}")
        return None

    def bounds(h, o, T, B):
        """Speed-ups the hybrid could reach at the original's efficiency (``cost``: :func:`cost_model`)."""
        ch, co = h.get("cost"), o.get("cost")
        if not ch or not co:
            return None, None
        prefill, decode = speedup_bounds(ch, co, T, h.get("cache_bytes"), o.get("cache_bytes"), B)
        return float(f"{prefill:.4g}"), float(f"{decode:.4g}") if decode else None

    for kind, (T, B) in ((k, tb) for k in hybrids for tb in keys):
        h, o = by.get((kind, T, B)), by.get(("original", T, B))
        if h is None or o is None:
            continue
        prefill_bound, decode_bound = bounds(h, o, T, B)
        out.append({"model": kind, "T": T, "B": B,
                    "prefill_speedup": frac(h, o, "prefill_tok_s"),
                    "decode_speedup": frac(h, o, "decode_tok_s"),
                    "cache_ratio": frac(h, o, "cache_bytes"),
                    "peak_ratio": frac(h, o, "peak_bytes"),
                    "prefill_bound": prefill_bound, "decode_bound": decode_bound,
                    "original": o["status"], "hybrid": h["status"]})
    return out


def check_targets(rat: list[dict]) -> list[dict]:
    """The speed goals that the measured rows can answer, per hybrid (``met`` is None when a side has no number)."""
    by = {(r.get("model", "hybrid"), r["T"], r["B"]): r for r in rat}
    out = []
    for kind in dict.fromkeys(r.get("model", "hybrid") for r in rat):
        for what, metric, T, B, (op, bound) in TARGETS:
            r = by.get((kind, T, B))
            if r is None:
                continue
            v = r.get(metric)
            met = None if v is None else (v >= bound if op == ">=" else v <= bound)
            out.append({"model": kind, "target": what, "T": T, "B": B, "metric": metric, "value": v, "met": met})
    return out


def _write(path: Path, result: dict) -> None:
    with atomic_write(path) as tmp:
        tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")


def _dominated(T: int, B: int, failed: list[tuple[int, int]]) -> bool:
    return any(T >= t and B >= b for t, b in failed)


def model_cache_bytes(model, T: int, B: int) -> int:
    """The closed-form cache + state bytes of ``model`` (original or hybrid) after a B x T prefill, in its dtype."""
    kind = "hybrid" if getattr(model.config, "model_type", "") == "linearize" else "original"
    return cache_bytes(model.config, T, B, next(model.parameters()).element_size())[kind]


def too_big(model, T: int, B: int, dev: torch.device) -> str | None:
    """Why a row cannot fit, without running it: what is resident (weights) plus the row's cache from the closed
    form exceed the GPU's memory; None when it may fit (or on CPU, where nothing is checked)."""
    if dev.type != "cuda":
        return None
    cache = model_cache_bytes(model, T, B)
    resident, total = torch.cuda.memory_allocated(dev), torch.cuda.get_device_properties(dev).total_memory
    if resident + cache <= total:
        return None
    return (f"skipped: weights {format_bytes(resident)} + cache {format_bytes(cache)} exceed the GPU's "
            f"{format_bytes(total)}")


def parse_ratios(value: str) -> list[str]:
    """``--ratio``: one A:B layout or a comma list of them (each hybrid is measured against one original run)."""
    items = list(dict.fromkeys(v.strip() for v in str(value).split(",") if v.strip()))
    if not items:
        raise LinearizeError(f"--ratio {value!r}: expected A:B, or a comma list such as 3:1,7:1")
    for r in items:
        parse_ratio(r)
    return items


def bench_model(spec: str, *, against: str | None = None, random_weights: bool = False, ratio: str = DEFAULT_RATIO,
                recipe: str = DEFAULT_RECIPE, lengths: Any = "4K,32K,128K", batches: Any = "1,8", decode_steps: int = 64,
                dtype: str | None = None, device: str | None = None, sdpa: str = "flash,cudnn",
                out_dir: Path | str = "bench-model", timing: Timing | None = None,
                log: Callable[[str], None] = print, profile: bool = False, prefill_chunk: int | None = None,
                overrides: dict[str, Any] | None = None) -> dict:
    """Benchmark the hybrid against the original; write ``out_dir/bench_model.json``; return the result.

    ``spec`` is a hybrid checkpoint directory (compared with ``against`` or the base model it names), or
    a model spec converted on the fly with surgery only (``ratio``, ``recipe``), compared with
    ``against`` or itself; ``ratio`` may list several layouts (``"3:1,7:1"``): the original runs once, then
    each hybrid, built afresh, with rows named ``hybrid A:B``. With ``random_weights`` the models come from a
    shipped config (alias) or a ``config.json`` path. ``profile``: also split a few eager decode steps per row by
    kernel category (:func:`profile_steps`); ``prefill_chunk``: the hybrids' ``prefill_chunk_tokens`` for the run
    (None: their config's; 0: one whole forward); ``overrides``: ``attention.*`` recipe fields for the on-the-fly
    conversions (``{"attention.window": 2048}``). See the module docstring for what each number means.
    """
    Ts, Bs = parse_lengths(lengths), parse_batch_sizes(batches)
    if int(decode_steps) < 1:
        raise LinearizeError(f"--decode-steps {decode_steps}: must be at least 1")
    try:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise LinearizeError(f"--device {device!r}: expected cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LinearizeError(f"--device {device}: no CUDA GPU is visible (use --device cpu)")
    if dev.type not in ("cuda", "cpu"):
        raise LinearizeError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    dt = resolve_dtype(dtype, dev)
    sdpa_names = parse_sdpa(sdpa)
    backends: list[str | None] = list(sdpa_names) if dev.type == "cuda" else [None]
    ratio_list = parse_ratios(ratio)
    if prefill_chunk is not None:
        try:
            prefill_chunk = check_chunk_size(prefill_chunk)
        except ValueError as e:
            raise LinearizeError(f"--prefill-chunk: {e}") from None
    # the original's prefill falls back to these pieces where one forward runs out of memory (bench_row)
    original_pieces = PREFILL_CHUNK_TOKENS if prefill_chunk is None else prefill_chunk
    overrides = dict(overrides or {})
    recipes.check_layer_overrides(overrides, "bench model")
    rec = recipes.load(recipe, overrides or None)
    timing = timing or (Timing() if dev.type == "cuda" else Timing(min_time=0.0, max_reps=1, warmup_steps=1))
    pairs = [plan_pair(spec, against=against, random_weights=random_weights, ratio=r, recipe=rec, dtype=dt,
                       device=dev, max_len=max(Ts)) for r in ratio_list]
    pair = pairs[0]
    if len(pairs) > 1 and pair.layout_from_checkpoint:
        raise LinearizeError(f"--ratio {ratio}: several layouts compare on-the-fly conversions; {spec} has its own")
    if overrides and pair.layout_from_checkpoint:
        raise LinearizeError(f"--set: {spec} has its own linear-attention settings (edit its config.json to serve "
                             f"it at another window); --set applies to on-the-fly conversions")
    kinds = ["hybrid"] if len(pairs) == 1 else [f"hybrid {r}" for r in ratio_list]
    described = [describe_layout(p.layer_types) if p.layer_types else None for p in pairs]
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / (RESULT_FILE + ".tmp")
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise LinearizeError(f"-o {out_dir}: cannot write there ({e.strerror or e})") from None
    out_path = out_dir / RESULT_FILE

    meta = {"date": _dt.datetime.now().isoformat(timespec="seconds"), **_versions(),
            "spec": spec, "against": against, "random_weights": random_weights,
            "original": pair.original_name, "hybrid": pair.hybrid_name,
            "ratio": None if pair.layout_from_checkpoint else ",".join(ratio_list),
            "recipe": None if pair.layout_from_checkpoint else rec.name, "overrides": overrides,
            "layout": "; ".join(described) if pair.layer_types else None,
            "layer_types": pair.layer_types, "dtype": str(dt).replace("torch.", ""), "device": str(dev),
            "hybrids": [{"model": k, "ratio": None if p.layout_from_checkpoint else r, "layout": d,
                         "layer_types": p.layer_types} for k, r, p, d in zip(kinds, ratio_list, pairs, described)],
            "lengths": Ts, "batches": Bs, "decode_steps": int(decode_steps),
            "sdpa_candidates": [b or "default" for b in backends],
            "timing": {"prefill_min_seconds": timing.min_time, "prefill_max_reps": timing.max_reps,
                       "decode_warmup_steps": timing.warmup_steps},
            "method": {
                "prefill": "one forward over B x T random ids, use_cache=True, logits of the last position; one warm-up, "
                           "median of timed runs; per SDPA backend, the fastest kept",
                "decode": "single-token steps at context T (softmax layers write position T-1 of their prefill KV, "
                          "attending to T keys; linear layers advance their state in place); CUDA graph replays "
                          "where capture works, else eager",
                "peak_bytes": "torch.cuda.max_memory_allocated over the row, weights included; n/a on CPU",
                "cache_bytes": "sum of the tensors in the cache after the prefill",
            },
            "notes": list(pair.notes)}
    result = {"meta": meta, "rows": [], "ratios": [], "targets": []}
    _write(out_path, result)

    def run_model(model, kind: str) -> None:
        model.eval()
        params = sum(p.numel() for p in model.parameters())
        meta[f"{kind}_parameters"] = params
        cost = cost_model(model)  # stored with each measured row: ratios() derives the bounds from it
        meta[f"{kind}_attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        failed: list[tuple[int, int]] = []
        for T in Ts:
            for B in Bs:
                why = ("skipped: a smaller row ran out of memory" if _dominated(T, B, failed)
                       else too_big(model, T, B, dev))
                if why:
                    row = {"model": kind, "T": T, "B": B, "status": "oom", "prefill_tok_s": "oom",
                           "decode_tok_s": "oom", "peak_bytes": "oom", "note": why}
                    failed.append((T, B))
                else:
                    t0 = time.time()
                    row = bench_row(model, kind, T, B, steps=int(decode_steps), backends=backends, dev=dev,
                                    timing=timing, profile=profile, pieces=original_pieces if kind == "original" else 0)
                    row["wall_s"] = round(time.time() - t0, 2)
                    row["cost"] = cost
                    if row["status"] == "oom" and row.get("oom_phase") == "prefill":
                        failed.append((T, B))
                result["rows"].append(row)
                result["ratios"] = ratios(result["rows"])
                result["targets"] = check_targets(result["ratios"])
                _write(out_path, result)
                log(_row_line(row))

    t0 = time.time()
    original = pair.build_original()
    log(f"original: {pair.original_name}, {sum(p.numel() for p in original.parameters()):,} parameters, "
        f"built in {time.time() - t0:.1f}s")
    run_model(original, "original")
    keep = len(pairs) == 1 and pair.hybrid_from_original  # one layout: made in place from the original
    if not keep:  # several: each hybrid from a fresh original, so no row holds two models' weights
        original = None
        _free(dev)
    for kind, p, d in zip(kinds, pairs, described):
        t0 = time.time()
        base = original if keep else (p.build_original() if p.hybrid_from_original else None)
        original = None
        hybrid = p.build_hybrid(base)
        base = None
        if prefill_chunk is not None:
            hybrid.config.prefill_chunk_tokens = prefill_chunk
        meta.setdefault("prefill_chunk_tokens", {})[kind] = getattr(hybrid.config, "prefill_chunk_tokens", None)
        log(f"{kind}: {p.hybrid_name}, {d or ''} built in {time.time() - t0:.1f}s")
        run_model(hybrid, kind)
        hybrid = None
        _free(dev)
    meta["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
    _write(out_path, result)
    return result


# ---------------------------------------------------------------------------------------------
# printing


def _fmt(v, spec: str = ",.0f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) else ("" if v is None else str(v))


def _row_line(r: dict) -> str:
    if r["status"] == "error":
        return f"{r['model']} T={r['T']} B={r['B']}: error {r.get('error', '')}"
    return (f"{r['model']} T={r['T']} B={r['B']}: prefill {_fmt(r.get('prefill_tok_s'))} tok/s "
            f"({r.get('prefill_sdpa', '-')}), decode {_fmt(r.get('decode_tok_s'))} tok/s "
            f"({r.get('decode_mode', '-')}, {r.get('decode_sdpa', '-')}), peak {format_bytes(r.get('peak_bytes'))}, "
            f"cache {format_bytes(r.get('cache_bytes'))}" + (f" [{r['note']}]" if r.get("note") else ""))


def print_result(result: dict, console=None) -> None:
    """The hybrid-vs-original table (and the speed goals the rows answer) with rich."""
    if console is None:
        # a captured (non-terminal) stdout would otherwise get 80 columns and truncate the 14-column table
        console = make_console()
    con = console
    meta = result["meta"]
    sets = "".join(f" | {k}={v}" for k, v in (meta.get("overrides") or {}).items())
    con.print(f"{meta['hybrid']} vs {meta['original']} | {meta.get('layout') or ''}{sets} | {meta['dtype']} on "
              f"{meta.get('gpu', meta['device'])} | torch {meta['torch']}, transformers {meta['transformers']}",
              highlight=False)
    by = {(r["model"], r["T"], r["B"]): r for r in result["rows"]}
    rat = {(r.get("model", "hybrid"), r["T"], r["B"]): r for r in result["ratios"]}
    layouts = {h["model"]: h.get("layout") for h in meta.get("hybrids", [])}
    several = len(layouts) > 1

    def val(r, k):
        v = r.get(k)
        return _fmt(v) if isinstance(v, (int, float)) or r.get("status") != "error" else "error"

    for kind in dict.fromkeys(r["model"] for r in result["rows"] if r["model"] != "original"):
        title = f"bench model: {kind} vs original (x = hybrid / original)"
        if several and layouts.get(kind):
            title += f"\n{layouts[kind]}"
        t = Table(title=title)
        for col in ("T", "B", "prefill tok/s orig", "hybrid", "x", "decode tok/s orig", "hybrid", "x",
                    "cache orig", "hybrid", "x", "peak orig", "hybrid", "x"):
            t.add_column(col, justify="right")
        for T, B in sorted({(r["T"], r["B"]) for r in result["rows"]}):
            o, h, x = by.get(("original", T, B), {}), by.get((kind, T, B), {}), rat.get((kind, T, B), {})

            def xr(k, spec=".2f"):
                return _fmt(x.get(k), spec)

            t.add_row(str(T), str(B), val(o, "prefill_tok_s"), val(h, "prefill_tok_s"), xr("prefill_speedup"),
                      val(o, "decode_tok_s"), val(h, "decode_tok_s"), xr("decode_speedup"),
                      format_bytes(o.get("cache_bytes", "")), format_bytes(h.get("cache_bytes", "")),
                      xr("cache_ratio", ".1%"), format_bytes(o.get("peak_bytes", "")),
                      format_bytes(h.get("peak_bytes", "")), xr("peak_ratio", ".1%"))
        con.print(t)
    modes = sorted({(r["model"], r.get("decode_mode"), r.get("decode_sdpa"), r.get("prefill_sdpa"))
                    for r in result["rows"] if r.get("status") == "ok"}, key=str)
    for model, dmode, dsdpa, psdpa in modes:
        con.print(f"  {model}: prefill SDPA {psdpa}; decode {dmode} (SDPA {dsdpa})", highlight=False)
    notes: dict[str, list[str]] = {}
    for r in result["rows"]:
        text = r.get("error") or r.get("decode_note") or r.get("note")
        if text:
            notes.setdefault(text, []).append(f"{r['model']} T={r['T']} B={r['B']}")
    for text, where in notes.items():
        con.print(f"  {text}: {', '.join(where)}", highlight=False)
    for r in result["rows"]:
        prof = r.get("decode_profile_ms")
        if prof:
            where = "GPU kernel" if str(meta["device"]).startswith("cuda") else "CPU operator"
            parts = ", ".join(f"{k} {v:.3f}" for k, v in prof.items() if k != "total")
            con.print(f"  {r['model']} T={r['T']} B={r['B']} decode step, {where} time in ms "
                      f"({r.get('decode_mode', 'eager')}, profiled): "
                      f"{parts} (total {prof['total']:.3f})", highlight=False)
            top = "; ".join(f"{name} {ms:.3f}" for name, ms in r.get("decode_profile_other_top", [])[:6])
            if top:
                con.print(f"    largest in other: {top}", highlight=False)
    for x in result.get("ratios", []):
        if x.get("prefill_bound") is not None:
            who = f"{x.get('model', 'hybrid')} " if several else ""
            con.print(f"  {who}T={x['T']} B={x['B']}: at the original's efficiency the hybrid's shapes allow prefill "
                      f"{_fmt(x['prefill_bound'], '.2f')}x (FLOPs per token; windows counted, linear parts free), "
                      f"decode {_fmt(x.get('decode_bound'), '.2f') or 'n/a'}x (bytes per step: weights + cache)",
                      highlight=False)
    for tg in result.get("targets", []):
        mark = {True: "reached", False: "not reached", None: "n/a"}[tg["met"]]
        who = f"{tg.get('model', 'hybrid')} " if several else ""
        con.print(f"  goal: {who}{tg['target']}: {_fmt(tg['value'], '.3f') or 'n/a'} ({mark})", highlight=False)
