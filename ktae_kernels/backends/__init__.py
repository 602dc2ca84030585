"""The backends, side by side: ``torch`` (vectorised), ``cpu`` (native C++ kernel), ``cuda`` (CUDA
kernels compiled by NVRTC at first use) and ``triton``. Each implements the contract of ``backends.base`` and depends only on the
shared lower modules (``method``, ``validation``, ``types``, ``config``, ``primitives``,
``backends.base``, ``backends.device``), never on another backend, the API or the registry.
"""
