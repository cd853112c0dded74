"""k3train: Megatron-style distributed pretraining for the Kimi K3 architecture.

The checkout keeps `parallel/` and `kernels/` beside `k3train/` (the layout Megatron users
expect); `k3train/parallel` and `k3train/kernels` are symbolic links to them, so they import as
`k3train.parallel` and `k3train.kernels` through the ordinary import system, and IDEs and type
checkers resolve them the same way. Nothing named `kernels` or `parallel` reaches the top level
of `sys.modules` (the two folders have no `__init__.py`, so a regular package of that name, such
as Hugging Face's `kernels`, always wins over them), and installed wheels carry both inside
`k3train/`.
"""

__version__ = "0.1.0"
