"""gpn_scale: training stack for Grounded Prediction Networks."""

__version__ = "0.1.0"
