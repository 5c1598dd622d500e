"""The local SLURM cluster fixtures (`slurm_cluster`, `slurm_env`); see gpn_scale.testing.slurm.

Other test directories can use them the same way (import them in their conftest.py), or the
root conftest can list "gpn_scale.testing.slurm" in `pytest_plugins`.
"""

from gpn_scale.testing.slurm import slurm_cluster, slurm_env  # noqa: F401
