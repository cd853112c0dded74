"""Contracts shared by the model (`k3train/model`) and the parallel code (`parallel/`): neither
side imports the other for them. `stage_io`: what crosses a pipeline stage boundary and when a
block closes; `param_roles`: how a parameter tells the optimizer what it is."""
