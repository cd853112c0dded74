"""Runs fla-core's KDA kernels (and its causal convolution and gated RMSNorm) under Triton's CPU interpreter against k3train's PyTorch path and
prints, per case, the largest deviation of every output and gradient over the reference's largest
magnitude, as JSON (run by tests/unit/test_kda_fla_interpreter.py in a subprocess with
`TRITON_INTERPRET=1`, which must be set before triton is imported).

Two adaptations of the interpreter, neither touching what a kernel computes:
- Compiled Triton gives a kernel's `for i in range(n)` counter as a tensor, the interpreter a
  Python int; fla's kernels call `.to(...)` on such counters. Inside a kernel launch, `range` in
  fla's modules yields 0-d int32 tensors (outside one, the builtin's ints).
- The autotuner times each configuration with a GPU benchmarker, which the interpreter lacks:
  here every configuration times equal, so the first is taken.
- Builtins fla bound to its own names at import (`gather = tl.gather`) are looked up at call
  time, when the interpreter has put its versions into `triton.language`; the dot precision
  `bf16x3`, which the interpreter does not accept, is given as `ieee` (its dots are numpy fp32
  products either way).
"""

from __future__ import annotations

import builtins
import importlib
import json
import os
import pkgutil
import sys

import numpy as np
import torch


def patch_interpreter() -> None:
    import triton.language as tl
    import triton.runtime.autotuner as autotuner
    from triton.runtime import interpreter

    autotuner.Autotuner._bench = lambda self, *args, config=None, **kwargs: [1.0, 1.0, 1.0]
    depth = [0]
    launch = interpreter.GridExecutor.__call__

    def counted_launch(self, *args, **kwargs):
        depth[0] += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            depth[0] -= 1

    interpreter.GridExecutor.__call__ = counted_launch

    def as_int(value):
        return int(np.asarray(value.handle.data).reshape(-1)[0]) if isinstance(value, tl.core.tensor) else value

    def kernel_range(*args):
        values = builtins.range(*(as_int(a) for a in args))
        if not depth[0]:
            return values
        return (
            tl.core.tensor(interpreter.TensorHandle(np.array(i, dtype=np.int32), tl.int32), tl.int32) for i in values
        )

    # Builtins that fla's modules bound at import (`gather = tl.gather`): the interpreter swaps
    # its own versions into `triton.language` for the duration of a launch, so look them up then.
    builtins_by_id = {
        id(getattr(namespace, name)): (namespace, name)
        for namespace in (tl, tl.math)
        for name in dir(namespace)
        if not name.startswith("_") and callable(getattr(namespace, name))
    }

    def late_bound(namespace, name):
        return lambda *args, **kwargs: getattr(namespace, name)(*args, **kwargs)

    import fla

    for info in pkgutil.walk_packages(fla.__path__, "fla."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # modules for other hardware
            continue
        vars(module)["range"] = kernel_range  # a global of the module, shadowing the builtin
        for attribute, value in list(vars(module).items()):
            if id(value) in builtins_by_id and not isinstance(value, type):
                setattr(module, attribute, late_bound(*builtins_by_id[id(value)]))
            elif isinstance(value, tl.constexpr) and value.value == "bf16x3":
                # a dot precision the interpreter does not list (it multiplies in numpy fp32 anyway)
                setattr(module, attribute, tl.constexpr("ieee"))


def deviations(fast, reference, names) -> dict[str, float]:
    """max |fast − reference| / max |reference| per named tensor."""
    return {
        name: float((a - b).detach().abs().max() / b.detach().abs().max().clamp_min(1e-30))
        for name, a, b in zip(names, fast, reference)
    }


def kda_values_and_grads(inputs, kda) -> list:
    """`kda()`'s output and final state, and every input's gradient under fixed random weights."""
    o, state = kda()
    weights = [
        torch.randn(o.shape, generator=torch.Generator().manual_seed(99)),
        torch.randn(state.shape, generator=torch.Generator().manual_seed(98)),
    ]
    grads = torch.autograd.grad((o * weights[0]).sum() + (state * weights[1]).sum(), inputs)
    return [o, state, *grads]


def plain_case(batch, seq, heads, key_dim, value_dim, seed):
    """`run_fla_chunk_kda` against `chunk_kda(backend="torch")`: g in (−5, 0), an initial state."""
    from k3train.kernels.kda import chunk_kda, fla_backend

    generator = torch.Generator().manual_seed(seed)
    shape = (batch, seq, heads, key_dim)
    inputs = [
        torch.nn.functional.normalize(torch.randn(shape, generator=generator), dim=-1),
        torch.nn.functional.normalize(torch.randn(shape, generator=generator), dim=-1),
        torch.randn(batch, seq, heads, value_dim, generator=generator),
        -5 * torch.rand(shape, generator=generator),
        torch.rand(batch, seq, heads, generator=generator),
        torch.randn(batch, heads, key_dim, value_dim, generator=generator),
    ]
    inputs = [x.requires_grad_() for x in inputs]
    scale = key_dim**-0.5

    fast = kda_values_and_grads(inputs, lambda: fla_backend.run_fla_chunk_kda(*inputs[:5], scale, inputs[5], True))
    reference = kda_values_and_grads(
        inputs,
        lambda: chunk_kda(*inputs[:5], scale=scale, initial_state=inputs[5], output_final_state=True, backend="torch"),
    )
    return deviations(fast, reference, ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "d_initial_state"])


def raw_case(batch, seq, heads, key_dim, value_dim, lower_bound, seed, safe_gate=False):
    """`run_fla_chunk_kda_from_raw` (normalisation, gate and sigmoid in fla's kernel) against
    `chunk_kda_from_raw(backend="torch")`."""
    from k3train.kernels.kda import fla_backend
    from k3train.kernels.kda.raw_inputs import chunk_kda_from_raw

    generator = torch.Generator().manual_seed(seed)
    shape = (batch, seq, heads, key_dim)
    inputs = [
        torch.randn(shape, generator=generator),
        torch.randn(shape, generator=generator),
        torch.randn(batch, seq, heads, value_dim, generator=generator),
        torch.randn(shape, generator=generator),  # the gate's input
        torch.randn(batch, seq, heads, generator=generator),  # β's logits
        0.5 * torch.randn(heads, generator=generator),  # A_log
        torch.randn(heads * key_dim, generator=generator),  # dt_bias
        torch.randn(batch, heads, key_dim, value_dim, generator=generator),
    ]
    inputs = [x.requires_grad_() for x in inputs]
    scale = key_dim**-0.5

    q, k, v, gate_input, beta_logits, a_log, dt_bias, state = inputs
    fast = kda_values_and_grads(
        inputs,
        lambda: fla_backend.run_fla_chunk_kda_from_raw(
            q, k, v, gate_input, beta_logits, a_log, dt_bias, lower_bound, scale, state, True, safe_gate=safe_gate
        ),
    )
    reference = kda_values_and_grads(
        inputs,
        lambda: chunk_kda_from_raw(
            q,
            k,
            v,
            gate_input,
            beta_logits,
            a_log,
            dt_bias,
            lower_bound,
            scale=scale,
            initial_state=state,
            output_final_state=True,
            backend="torch",
        ),
    )
    return deviations(
        fast,
        reference,
        [
            "o",
            "final_state",
            "dq",
            "dk",
            "dv",
            "d_gate_input",
            "d_beta_logits",
            "dA_log",
            "d_dt_bias",
            "d_initial_state",
        ],
    )


def short_conv_case(batch, seq, channels, taps, seed):
    """`run_fla_short_conv_silu` (fla's causal convolution with SiLU) against `short_conv_silu`'s
    PyTorch path, no tail (what runs on fla)."""
    from k3train.kernels.kda import fla_backend
    from k3train.kernels.short_conv import short_conv_silu

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, channels, generator=generator).requires_grad_()
    weight = torch.randn(channels, 1, taps, generator=generator).requires_grad_()
    grad_output = torch.randn(batch, seq, channels, generator=generator)

    def run(conv):
        output = conv()
        return [output, *torch.autograd.grad((output * grad_output).sum(), [x, weight])]

    fast = run(lambda: fla_backend.run_fla_short_conv_silu(x, weight))
    reference = run(lambda: short_conv_silu(x, weight)[0])
    return deviations(fast, reference, ["y", "dx", "dweight"])


def gated_norm_case(batch, seq, heads, head_dim, seed):
    """`run_fla_gated_rms_norm` (fla's fused gated RMSNorm) against `gated_rms_norm`'s PyTorch
    path: KDA's output norm, per head."""
    from k3train.kernels.kda import fla_backend
    from k3train.kernels.norms import gated_rms_norm

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, heads, head_dim, generator=generator).requires_grad_()
    gate = torch.randn(batch, seq, heads, head_dim, generator=generator).requires_grad_()
    weight = (1 + 0.1 * torch.randn(head_dim, generator=generator)).requires_grad_()
    grad_output = torch.randn(batch, seq, heads, head_dim, generator=generator)

    def run(norm):
        output = norm()
        return [output, *torch.autograd.grad((output * grad_output).sum(), [x, gate, weight])]

    fast = run(lambda: fla_backend.run_fla_gated_rms_norm(x, gate, weight, 1e-5))
    reference = run(lambda: gated_rms_norm(x, gate, weight, 1e-5, backend="torch"))
    return deviations(fast, reference, ["y", "dx", "dgate", "dweight"])


def varlen_kda_case(seed):
    """`run_fla_chunk_kda` with `cu_seqlens` (segments of 5, 37, 1 and 21 tokens, one initial
    state each) against `chunk_kda_varlen(backend="torch")`."""
    from k3train.kernels.kda import fla_backend
    from k3train.kernels.kda.varlen import chunk_kda_varlen

    generator = torch.Generator().manual_seed(seed)
    cu_seqlens = torch.tensor([0, 5, 42, 43, 64])
    heads, key_dim, value_dim, tokens = 2, 32, 16, 64
    shape = (1, tokens, heads, key_dim)
    inputs = [
        torch.nn.functional.normalize(torch.randn(shape, generator=generator), dim=-1),
        torch.nn.functional.normalize(torch.randn(shape, generator=generator), dim=-1),
        torch.randn(1, tokens, heads, value_dim, generator=generator),
        -5 * torch.rand(shape, generator=generator),
        torch.rand(1, tokens, heads, generator=generator),
        torch.randn(4, heads, key_dim, value_dim, generator=generator),
    ]
    inputs = [x.requires_grad_() for x in inputs]
    scale = key_dim**-0.5
    fast = kda_values_and_grads(
        inputs, lambda: fla_backend.run_fla_chunk_kda(*inputs[:5], scale, inputs[5], True, cu_seqlens=cu_seqlens)
    )
    reference = kda_values_and_grads(
        inputs,
        lambda: chunk_kda_varlen(
            *inputs[:5], cu_seqlens, scale=scale, initial_state=inputs[5], output_final_state=True, backend="torch"
        ),
    )
    return deviations(fast, reference, ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "d_initial_state"])


def varlen_short_conv_case(seed):
    """`run_fla_short_conv_silu` with `cu_seqlens` against `short_conv_silu_varlen(backend="torch")`."""
    from k3train.kernels.kda import fla_backend
    from k3train.kernels.short_conv import short_conv_silu_varlen

    generator = torch.Generator().manual_seed(seed)
    cu_seqlens = torch.tensor([0, 2, 19, 20, 37])
    x = torch.randn(1, 37, 24, generator=generator).requires_grad_()
    weight = torch.randn(24, 1, 4, generator=generator).requires_grad_()
    grad_output = torch.randn(1, 37, 24, generator=generator)

    def run(conv):
        output = conv()
        return [output, *torch.autograd.grad((output * grad_output).sum(), [x, weight])]

    fast = run(lambda: fla_backend.run_fla_short_conv_silu(x, weight, cu_seqlens=cu_seqlens))
    reference = run(lambda: short_conv_silu_varlen(x, weight, cu_seqlens, backend="torch"))
    return deviations(fast, reference, ["y", "dx", "dweight"])


CASES = {
    "plain, T=80 (padded)": lambda: plain_case(2, 80, 2, 32, 16, seed=0),
    "raw inputs, bounded gate (-5)": lambda: raw_case(2, 80, 2, 32, 16, lower_bound=-5.0, seed=1),
    "raw inputs, unbounded gate": lambda: raw_case(1, 64, 2, 32, 16, lower_bound=None, seed=2),
    "raw inputs, bounded gate, safe_gate": lambda: raw_case(1, 80, 2, 32, 16, lower_bound=-5.0, seed=3, safe_gate=True),
    "short conv + SiLU, T=37": lambda: short_conv_case(2, 37, 24, 4, seed=4),
    "gated RMSNorm": lambda: gated_norm_case(2, 37, 3, 32, seed=5),
    "varlen KDA (4 segments)": lambda: varlen_kda_case(seed=6),
    "varlen short conv + SiLU (4 segments)": lambda: varlen_short_conv_case(seed=7),
}


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    torch.set_num_threads(1)
    patch_interpreter()
    names = sys.argv[1:] or list(CASES)
    print(json.dumps({name: CASES[name]() for name in names}))


if __name__ == "__main__":
    main()
