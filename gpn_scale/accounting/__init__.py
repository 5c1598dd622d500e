"""What a step costs on a GPU, found without one: the launch / byte / FLOP accounting of the
real code path run on meta tensors (`gpu_model`), its tensor-parallel form (`tp_model`), the
Transformer++ it is compared with (`baseline_model`), and every Triton kernel compiled ahead
of time for sm_90 / sm_80 (`gpu_compile`: registers, spills, occupancy; the compile gate).

A library: `gpn_scale.scaling` prices sweeps with it; each module with a `main` is also a
command that prints its tables (`python -m gpn_scale.accounting.gpu_model`)."""
