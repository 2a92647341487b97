"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""


class LinearizeError(Exception):
    """Base class: a problem with the user's input or environment, reported in one line."""

    exit_code = 2


class SpecError(LinearizeError):
    """A model spec that cannot be resolved or loaded."""


class RecipeError(LinearizeError):
    """A recipe that cannot be found or does not validate."""


class DataError(LinearizeError, ValueError):
    """A data spec, file or setting that cannot be used; the message is one line saying what to do."""


class SelectionError(LinearizeError):
    """A layer layout (ratio, explicit list) that does not fit the model."""


class OutputError(LinearizeError):
    """An output path that cannot be written (exists, not writable)."""


class UnsupportedModelError(LinearizeError):
    """An architecture this tool cannot convert."""


class TrainingError(LinearizeError):
    """A training run that cannot continue (non-finite or exploding loss, fingerprint mismatch)."""


class TrainingInterrupted(LinearizeError):
    """Ctrl-C during training: a resumable checkpoint was saved."""

    exit_code = 130


class ResourceError(LinearizeError):
    """Out of memory (GPU or host): the message names where and what to change."""

    exit_code = 3


class DeviceError(LinearizeError):
    """The GPU context died (an illegal address in a kernel): nothing more can run in this process."""

    exit_code = 4
