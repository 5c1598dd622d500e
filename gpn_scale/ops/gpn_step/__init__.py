"""One op: a GPN chunk's sequential time steps, forward and the hand-written reverse sweep.

`interface.py` is the seam (the plan, the loop weights, the backend protocol); the backends
are `reference.py` (the PyTorch steps, the slow obviously correct one), `cpu.py` (the fused
C++ kernels of `csrc/`) and `cuda.py` (the Triton kernels of `triton_kernels.py`, its
few-row GEMMs planned and launched by `gemm.py`, launch sizes from `geometry.py`, chunks
captured as CUDA graphs by `graphs.py`); `registry.py` picks one. The engine that calls them
is `gpn_scale.models.gpn.engine`. The modules are imported by name (nothing is re-exported
here): importing the package costs nothing.
"""
