"""What joins the trainer and evaluation: the commands that build a training run, `gpn-scale
train | demo | eval` (commands.py, demo.py), and the run they build (assemble.py: the
Trainer with the step callbacks its config asks for, the live state analyses among them).
Above gpn_scale/train and gpn_scale/eval, below the cli: neither of those imports it."""
