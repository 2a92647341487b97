"""Which layers stay softmax: `--ratio A:B` or an explicit `--softmax-layers` list.

The result is a `layer_types` list in the transformers convention used by Qwen3-Next:
``"linear_attention"`` or ``"full_attention"`` per decoder layer.
"""

from __future__ import annotations

from .errors import SelectionError

LINEAR = "linear_attention"
FULL = "full_attention"


def parse_ratio(ratio: str) -> tuple[int, int]:
    """Parse ``"A:B"``: A linear layers for every B softmax layers, repeating."""
    parts = str(ratio).strip().split(":")
    if len(parts) != 2:
        raise SelectionError(f"--ratio {ratio!r}: expected A:B with two non-negative integers, e.g. 3:1")
    try:
        a, b = (int(p) for p in parts)
    except ValueError:
        raise SelectionError(f"--ratio {ratio!r}: expected A:B with two non-negative integers, e.g. 3:1") from None
    if a < 0 or b < 0:
        raise SelectionError(f"--ratio {ratio!r}: A and B must be >= 0")
    if a == 0 and b == 0:
        raise SelectionError(f"--ratio {ratio!r}: A and B cannot both be 0 (use 1:0 for all-linear, 0:1 for none)")
    return a, b


def layout_from_ratio(ratio: str, num_layers: int) -> list[str]:
    """Repeat A linear then B softmax layers. ``3:1`` on 30 layers keeps 3,7,...,27 softmax."""
    a, b = parse_ratio(ratio)
    period = a + b
    return [LINEAR if (i % period) < a else FULL for i in range(num_layers)]


def parse_layer_list(spec: str) -> list[int]:
    """Parse ``"3,7,11"`` (ranges ``"0-3"`` allowed) into sorted unique indices."""
    out: set[int] = set()
    text = str(spec).strip()
    if not text:
        return []
    for item in text.split(","):
        item = item.strip()
        try:
            if "-" in item:
                lo, hi = (int(x) for x in item.split("-", 1))
                if hi < lo:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(item))
        except ValueError:
            raise SelectionError(
                f"--softmax-layers {spec!r}: {item!r} is not a layer index or range (expected e.g. 3,7,11 or 0-3)"
            ) from None
    return sorted(out)


def layout_from_softmax_layers(indices: list[int], num_layers: int) -> list[str]:
    """All layers linear except the given softmax indices."""
    bad = [i for i in indices if i < 0 or i >= num_layers]
    if bad:
        raise SelectionError(
            f"--softmax-layers: layer index {bad[0]} is out of range: the model has {num_layers} layers (0..{num_layers - 1})"
        )
    keep = set(indices)
    return [FULL if i in keep else LINEAR for i in range(num_layers)]


def select_layout(num_layers: int, *, ratio: str | None = None, softmax_layers: str | None = None) -> list[str]:
    """Resolve the layout; an explicit list overrides the ratio; the default is 3:1."""
    if softmax_layers is not None:
        return layout_from_softmax_layers(parse_layer_list(softmax_layers), num_layers)
    return layout_from_ratio(ratio or "3:1", num_layers)


def describe_layout(layer_types: list[str]) -> str:
    """A compact one-line map, e.g. ``LLLS LLLS ...`` with counts."""
    chars = "".join("S" if t == FULL else "L" for t in layer_types)
    n_lin = chars.count("L")
    return f"{chars}  ({n_lin} linear, {len(chars) - n_lin} softmax)"


def softmax_indices(layer_types: list[str]) -> list[int]:
    return [i for i, t in enumerate(layer_types) if t == FULL]
