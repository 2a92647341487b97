"""A conversion: the plan (:mod:`.plan`), choosing the softmax layers (:mod:`.selection`, and the ``--select auto``
probe, :mod:`.probe`), the surgery that swaps attention modules (:mod:`.surgery`) and the pipeline that runs it all
from spec to checkpoint (:mod:`.pipeline`)."""
