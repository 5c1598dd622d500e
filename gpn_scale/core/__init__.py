"""Leaf package: what every other package may use and that imports none of them: the one-line
config error and YAML resolution (config), the launch environment of torchrun / SLURM (env),
device peaks for MFU (hardware), quiet ends of piped output (pipes)."""
