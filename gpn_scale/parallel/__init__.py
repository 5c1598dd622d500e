"""Parallelism applied to a built model: topology (process groups, DeviceMesh), FSDP2, DeepSpeed;
the train module the trainer drives (train_module.py: the model under its sharding strategy)."""
