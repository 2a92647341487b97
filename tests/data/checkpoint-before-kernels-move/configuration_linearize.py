"""The linearize hybrid's config class (for ``trust_remote_code=True``); written by linearize 0.1.0."""
from .modeling_linearize import LinearizeConfig  # noqa: F401
