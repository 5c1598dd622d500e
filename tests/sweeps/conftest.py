"""Sweep launch tests: the local SLURM cluster fixtures (see gpn_scale.testing.slurm)."""

from gpn_scale.testing.slurm import slurm_cluster, slurm_env  # noqa: F401
