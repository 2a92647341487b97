"""The hybrid model's runtime: what every checkpoint bundles as its remote code.

architectures (every family fact), layout (layer types), feature_maps, attention (the linear layer), cache
(the hybrid cache), prefill (long inference forwards in cached chunks), modeling (config and model classes).
These modules import only each other, the kernels
(``linearize.kernels``) and the two dependency-free helpers ``linearize.errors`` and ``linearize.atomic``
(checked by ``tests/test_structure.py``).
"""
