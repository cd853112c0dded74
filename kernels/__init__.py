"""Compute kernels, imported as `k3train.kernels`: tensors in, tensors out.

Each op keeps a plain-PyTorch reference next to its fast path and a test that holds them
together (the flash-linear-attention convention). Nothing here knows about models or
process groups.
"""
