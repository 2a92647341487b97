"""Benchmarks and the numbers behind ``info``: the kernels against fla and SDPA (:mod:`.kernels`), a hybrid
against its original (:mod:`.model`), training throughput (:mod:`.train`), the ``info`` report (:mod:`.info`) and
the cost model ``info`` and ``bench model`` share (:mod:`.costs`)."""
