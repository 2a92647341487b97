"""Layer types of a hybrid (``config.hybrid_layer_types``, and their transformers spelling ``config.layer_types``)."""

#: a converted layer of linear attention with feature maps (:class:`~linearize.model.attention.LinearAttention`)
LINEAR = "linear_attention"
#: a converted layer running the gated delta rule (:class:`~linearize.model.delta_attention.GatedDeltaAttention`)
GATED_DELTA = "gated_delta"
#: a softmax-attention layer kept from the original
FULL = "full_attention"
#: the types of converted layers (a recipe's ``attention.layer_type`` is one of them)
CONVERTED = (LINEAR, GATED_DELTA)


def transformers_layer_types(layer_types: list[str]) -> list[str]:
    """``layer_types`` in transformers' vocabulary, which its configs validate (on creation and on save) and its
    caches are built from: every converted layer is ``linear_attention`` (transformers' name for recurrent layers,
    the gated delta rule's included: Qwen3-Next's configs say so), a softmax layer ``full_attention``."""
    return [LINEAR if t in CONVERTED else t for t in layer_types]


def layer_range(text, what: str = "layers") -> range:
    """The decoder layers ``text`` names: one (``24``) or an inclusive range (``0-19``); ValueError naming ``what``
    otherwise."""
    lo, sep, hi = str(text).strip().partition("-")
    try:
        first, last = int(lo), int(hi if sep else lo)
    except ValueError:
        raise ValueError(f"{what} {text!r}: expected a layer (24) or a range (0-19)") from None
    if not 0 <= first <= last:
        raise ValueError(f"{what} {text!r}: expected layers >= 0, the first no later than the last")
    return range(first, last + 1)


def parse_layer_windows(mapping: dict | None) -> dict[int, int]:
    """``attention.layer_windows`` as ``{layer: width}``: each key a decoder layer (``24``) or an inclusive range
    (``"0-19"``), each value that layer's sliding window in tokens (1-4096). ValueError naming the bad entry; a
    layer named twice is refused."""
    out: dict[int, int] = {}
    for key, width in (mapping or {}).items():
        layers = layer_range(key, "layer_windows key")
        if type(width) is not int or not 1 <= width <= 4096:
            raise ValueError(f"layer_windows[{key!r}] = {width!r}: expected a window width in [1, 4096] tokens")
        for i in layers:
            if i in out:
                raise ValueError(f"layer_windows names layer {i} twice")
            out[i] = width
    return out


def layer_window(settings: dict, layer_idx: int) -> int:
    """The sliding window of converted layer ``layer_idx`` (0: none): its ``layer_windows`` entry, else the
    layers' ``window``."""
    return parse_layer_windows(settings.get("layer_windows")).get(layer_idx, int(settings.get("window") or 0))


def widest_window(settings: dict) -> int:
    """The widest sliding window of any converted layer (``window`` or a ``layer_windows`` entry; 0: none)."""
    return max([int(settings.get("window") or 0), *parse_layer_windows(settings.get("layer_windows")).values()])


def training_width(settings: dict, stage: dict | None = None) -> int | None:
    """The sliding window the training stages (and the layer-choice probe) run every windowed layer at:
    ``train_window`` when set, so a hybrid can train narrow and serve at its ``window`` / ``layer_windows``;
    None (each layer's own) otherwise. ``stage`` (a training stage's recipe section) may hold its own
    ``train_window``: null = the attention's, 0 = each layer's own, N = N tokens (stage 2 fitted at the served
    width after stage 1 trained narrow)."""
    own = (stage or {}).get("train_window")
    if own is not None:
        return int(own) or None
    return int(settings.get("train_window") or 0) or None
