"""Self-contained remote code for hybrid checkpoints.

A checkpoint's ``auto_map`` points at ``configuration_linearize.py`` and ``modeling_linearize.py`` in its own
directory, so ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` loads it on a machine
without this package. transformers copies those files, and the files they import relatively, into its module
cache; it follows only flat ``from .name import`` imports. :func:`remote_code_files` therefore writes the
modules a hybrid needs to load and run (model, layers, family table, cache, feature maps, kernels) as flat files
with their package-relative imports rewritten to the flat names (``BUNDLE``), and replaces imports of a few
constants from modules that are not bundled by their values (``CONSTANTS``). Anything else is refused, so a new
import in a bundled module fails loudly in the tests instead of in a user's ``from_pretrained``.

The bundled model does not register itself with the Auto classes (``import linearize`` does that for the
package's own classes).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from .version import __version__

#: bundled module -> flat file name (without .py) in the checkpoint directory
BUNDLE = {
    "linearize.model.modeling": "modeling_linearize",
    "linearize.model.attention": "linearize_attention",
    "linearize.model.delta_attention": "linearize_delta_attention",
    "linearize.model.architectures": "linearize_architectures",
    "linearize.model.cache": "linearize_cache",
    "linearize.model.feature_maps": "linearize_feature_maps",
    "linearize.model.layout": "linearize_layout",
    "linearize.model.norms": "linearize_norms",
    "linearize.model.prefill": "linearize_prefill",
    "linearize.model.softmax_attention": "linearize_softmax_attention",
    "linearize.errors": "linearize_errors",
    "linearize.atomic": "linearize_atomic",
    "linearize.kernels": "linearize_kernels",
    **{f"linearize.kernels.{m}": f"linearize_kernels_{m}" for m in (
        "chunked", "reference", "step", "triton_common", "triton_features", "triton_linear", "triton_norm", "triton_rotary",
        "triton_step", "triton_window", "tuning", "delta", "delta_chunked", "delta_reference", "delta_step",
        "triton_delta", "triton_delta_step", "sinks")},
}
#: modules whose imported names are written as constants instead of bundling the module
CONSTANTS = {"linearize.version": ("__version__",)}
#: module-level lines dropped from a bundled module
DROP = {"linearize.model.modeling": ("register_auto_classes()",)}

CONFIG_FILE = '''"""The linearize hybrid's config class (for ``trust_remote_code=True``); written by linearize {version}."""
from .modeling_linearize import LinearizeConfig  # noqa: F401
'''

# transformers refuses remote code whose imports are not installed, except imports inside try/except; the
# Triton modules are imported only where kernels can run (CUDA, or TRITON_INTERPRET=1)
_TRITON_IMPORTS = "import triton\nimport triton.language as tl\n"
_TRITON_IMPORTS_GUARDED = """try:  # imported only where the Triton kernels run
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install without Triton never calls this module
    triton = tl = None
"""
_FROM = re.compile(r"^(?P<indent>[ \t]*)from (?P<mod>\.*[\w.]*) import (?P<names>\([^)]*\)|[^\n#]+)(?P<tail>[^\n]*)$",
                   re.MULTILINE)


def _absolute(package: str, target: str) -> str:
    """The module ``from TARGET import`` names inside a module of ``package`` (its ``__init__`` included)."""
    if not target.startswith("."):
        return target
    dots = len(target) - len(target.lstrip("."))
    base = package.split(".")
    base = base[: len(base) - (dots - 1)]
    rest = target[dots:]
    return ".".join(base + ([rest] if rest else []))


def _names(spec: str) -> list[tuple[str, str]]:
    """``a, b as c`` -> [(a, a), (b, c)]."""
    out = []
    for part in spec.strip("() \n").replace("\n", " ").split(","):
        part = part.strip()
        if part:
            name, _, alias = part.partition(" as ")
            out.append((name.strip(), (alias or name).strip()))
    return out


def _rewrite(module: str, source: str) -> str:
    is_package = Path(importlib.import_module(module).__file__).name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]

    def replace(m: re.Match) -> str:
        indent, target, names = m["indent"], m["mod"], _names(m["names"])
        if target == "__future__" or not (target.startswith(".") or target.split(".")[0] == "linearize"):
            return m[0]
        absolute = _absolute(package, target)
        if all(f"{absolute}.{n}" in BUNDLE for n, _ in names):  # from . import triton_linear, ...
            return f"{indent}from . import " + ", ".join(f"{BUNDLE[f'{absolute}.{n}']} as {a}" for n, a in names)
        if absolute in BUNDLE:
            return f"{indent}from .{BUNDLE[absolute]} import {m['names']}{m['tail']}"
        if absolute in CONSTANTS and all(n in CONSTANTS[absolute] for n, _ in names):
            values = importlib.import_module(absolute)
            return "\n".join(f"{indent}{alias} = {getattr(values, name)!r}" for name, alias in names)
        raise RuntimeError(f"bundle: {module} imports {target} ({absolute}), which is not bundled")

    text = _FROM.sub(replace, source).replace(_TRITON_IMPORTS, _TRITON_IMPORTS_GUARDED)
    for line in DROP.get(module, ()):
        text = re.sub(rf"^{re.escape(line)}\n", "", text, flags=re.MULTILINE)
    return text


def remote_code_files() -> dict[str, str]:
    """``{file name: text}`` of the remote code a checkpoint directory carries."""
    files = {}
    for module, flat in BUNDLE.items():
        path = Path(importlib.import_module(module).__file__)
        header = f"# Bundled by linearize {__version__} from {module} for trust_remote_code=True; do not edit.\n"
        files[f"{flat}.py"] = header + _rewrite(module, path.read_text())
    files["configuration_linearize.py"] = CONFIG_FILE.format(version=__version__)
    return files
