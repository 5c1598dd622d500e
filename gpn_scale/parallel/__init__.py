"""Parallelism applied to a built model: topology (process groups, DeviceMesh), FSDP2, DeepSpeed."""
