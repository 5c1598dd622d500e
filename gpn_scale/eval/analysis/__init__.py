"""The paper's state analyses of GPN / GPN+M (offline: `gpn-scale analyze`; live: train).

One module per analysis, each a running accumulator over streamed states:
geometry (covariance spectrum), mean_direction, horizon (state horizon), memory (memory
horizon per head); stream.py feeds them from the reference step path, report.py writes the
outputs, live.py computes the cheap ones during training, load.py gets the model.
"""
