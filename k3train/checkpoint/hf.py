"""Kimi K3 Hugging Face hub format ⇄ k3train: tensor names, shapes and values.

The list of tensors is read from the model itself (`K3ModelChunk` built on the meta device); what this
module states is only the renaming rules (`hf_name`, `k3train_name`), the hub's name vocabulary
(`HF_TEXT_TENSOR_NAME`) and the file order. The layout, the name mapping and the `A_log`
variants are described in docs/hf_conversion.md. Everything here is pure (config in,
names/shapes/tensors out); `config.json` is in `hf_config.py`, the read-only I/O in `hf_io.py`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from k3train.errors import UserError
from k3train.model.config import ModelConfig

HF_TEXT_PREFIX = "language_model.model."
HF_LM_HEAD = "language_model.lm_head.weight"
FP32_TENSOR_SUFFIXES = ("gate.e_score_correction_bias", "self_attn.A_log", "self_attn.dt_bias", "conv1d.weight")
"""Tensors exported as float32 whatever `--dtype` says (F32 in the published checkpoint)."""

_ATTN_RES_PAIRS = ("self_attention_res", "mlp_res", "output_attn_res")
_EXPERT_WEIGHTS = ("w1", "w3", "w2")  # gate, up, down (HF order of the reference listing)
_K3_EXPERT_STACK = re.compile(r"(layers\.\d+\.block_sparse_moe\.experts)\.(w[123])")
"""A k3train stack of routed experts `[E, out, in]`; the hub stores each expert's slice."""

# The hub lists a KDA layer's decay-gate parameters after f_b_proj (they act on its output); the
# model registers them before its submodules. Every other tensor is written in the model's order.
_HF_PLACED_AFTER = {"self_attn.f_b_proj.weight": ("self_attn.dt_bias", "self_attn.A_log")}

_HF_TEXT_BODY = (
    r"embed_tokens\.weight|norm\.weight|"
    r"output_attn_res_(norm|proj)\.weight|layers\.\d+\.("
    r"(input_layernorm|post_attention_layernorm|(self_attention|mlp)_res_(norm|proj))\.weight|"
    r"self_attn\.((q|k|v|g|o|b|f_a|f_b|g_a|g_b)_proj\.weight|(q|k|v)_conv1d\.weight|dt_bias|A_log|o_norm\.weight|"
    r"(q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj)\.weight)|"
    r"mlp\.(gate|up|down)_proj\.weight|"
    r"block_sparse_moe\.(gate\.weight|gate\.e_score_correction_bias|routed_expert_(down_proj|norm|up_proj)\.weight|"
    r"experts\.\d+\.w[123]\.weight|shared_experts\.(gate|up|down)_proj\.weight))"
)


@dataclass(frozen=True)
class HubLayout:
    """Where a hub format puts the text model's tensors (docs/hf_conversion.md)."""

    name: str
    """`kimi_k3` (the K3 hub layout, a text model inside a multimodal wrapper) or `kimi_linear`."""
    text_prefix: str
    """Prefix of every text-model tensor but the head."""
    lm_head: str
    """Full name of the output head."""
    a_log_4d: bool
    """`A_log` stored as `[1, 1, H, 1]` (Kimi Linear in transformers) instead of `[H]`."""
    namespace: str
    """Names starting with this belong to the text model (the rest, e.g. a vision tower, is ignored)."""

    @property
    def tensor_name(self) -> re.Pattern[str]:
        return _layout_pattern(self.text_prefix, self.lm_head)

    @property
    def title(self) -> str:
        return {"kimi_k3": "Kimi K3", "kimi_linear": "Kimi Linear"}.get(self.name, self.name)

    def is_text_tensor(self, name: str) -> bool:
        """Whether `name` belongs to the text model's namespace (known name or not)."""
        return name == self.lm_head or name.startswith(self.namespace)


def _layout_pattern(prefix: str, lm_head: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(lm_head)}|{re.escape(prefix)}({_HF_TEXT_BODY})")


K3_HUB = HubLayout("kimi_k3", HF_TEXT_PREFIX, HF_LM_HEAD, a_log_4d=False, namespace="language_model.")
KIMI_LINEAR_HUB = HubLayout("kimi_linear", "model.", "lm_head.weight", a_log_4d=True, namespace="model.")
HUB_LAYOUTS = {layout.name: layout for layout in (K3_HUB, KIMI_LINEAR_HUB)}

HF_TEXT_TENSOR_NAME = _layout_pattern(HF_TEXT_PREFIX, HF_LM_HEAD)
"""Every tensor name of the Kimi K3 hub text model (docs/hf_conversion.md lists them)."""

# Spellings a reader accepts besides the one written: transformers' `save_pretrained` of Kimi
# Linear renames every `.mlp.` back to `.block_sparse_moe.`, the dense MLP of the first layers too.
_STORED_ALIASES = ((re.compile(r"(.*layers\.\d+\.)mlp\.((gate|up|down)_proj\.weight)"), r"\1block_sparse_moe.\2"),)


class HFConversionError(UserError, ValueError):
    """A configuration, tensor or checkpoint that cannot be converted; the message (one line) says
    which and why."""


# ============================================================================ tensor specs


@dataclass(frozen=True)
class TensorSpec:
    """One HF tensor and where it lives in the k3train state dict."""

    k3_name: str
    """k3train state-dict name (no `model.` checkpoint prefix)."""
    hf_name: str
    """Full hub name (`language_model.model.…`)."""
    shape: tuple[int, ...]
    """HF shape."""
    k3_shape: tuple[int, ...]
    """Shape of the whole k3train tensor (the stack `[E, …]` for routed experts)."""
    expert: int | None = None
    """Index into the stacked k3train tensor; None: the whole tensor."""
    keep_fp32: bool = False
    """Exported as float32 whatever the requested dtype."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def export_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.keep_fp32 else dtype

    def nbytes(self, dtype: torch.dtype) -> int:
        return self.numel * self.export_dtype(dtype).itemsize


def _keeps_fp32(k3_name: str) -> bool:
    return k3_name.endswith(FP32_TENSOR_SUFFIXES)


def k3_state_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of `K3ModelChunk(config).state_dict()` (persistent buffers included) and its shape,
    in the model's order: the model is built on the meta device, so no weight is allocated. A tied
    head keeps its own key, as in the model."""
    from k3train.model.k3 import K3ModelChunk  # the model's code is imported only when a list is needed

    with torch.device("meta"):
        model = K3ModelChunk(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def _split_layer(k3_name: str) -> tuple[str, str]:
    """(`layers.L.` or "", the rest of the name)."""
    match = re.match(r"layers\.\d+\.", k3_name)
    return (match.group(0), k3_name[match.end() :]) if match else ("", k3_name)


def hf_file_order(k3_names: Sequence[str]) -> list[str]:
    """`k3_names` (in the model's order) in the order the hub files list them: the model's order,
    except the names `_HF_PLACED_AFTER` moves behind another tensor of the same layer."""
    present = set(k3_names)
    anchor_of = {moved: anchor for anchor, group in _HF_PLACED_AFTER.items() for moved in group}
    ordered: list[str] = []
    for name in k3_names:
        layer, rest = _split_layer(name)
        if rest in anchor_of and layer + anchor_of[rest] in present:
            continue  # written behind its anchor
        ordered.append(name)
        ordered += [layer + moved for moved in _HF_PLACED_AFTER.get(rest, ()) if layer + moved in present]
    return ordered


def hf_name(k3_name: str, expert: int | None = None, layout: HubLayout = K3_HUB) -> str:
    """The hub name of a k3train tensor (of expert `expert` for a stacked expert tensor).

    Raises `HFConversionError` for a tensor with no place in the hub layout (`HF_TEXT_TENSOR_NAME`):
    a parameter added to the model needs a rule here before it can be exported.
    """
    if k3_name == "lm_head.weight":
        return layout.lm_head
    name = k3_name
    for pair in _ATTN_RES_PAIRS:
        name = re.sub(rf"(^|\.){pair}\.(norm|proj)\.weight$", rf"\1{pair}_\2.weight", name)
    match = _K3_EXPERT_STACK.fullmatch(name)
    if match:
        if expert is None:
            raise ValueError(f"{k3_name} is a stack of experts: pass the expert index")
        name = f"{match.group(1)}.{expert}.{match.group(2)}.weight"
    elif expert is not None:
        raise ValueError(f"{k3_name} is not an expert stack")
    if not layout.tensor_name.fullmatch(layout.text_prefix + name):
        raise HFConversionError(
            f"k3train tensor {k3_name} has no name in the {layout.title} hub layout: add its renaming rule and "
            "hub name to k3train/checkpoint/hf.py (hf_name, k3train_name, HF_TEXT_TENSOR_NAME)"
        )
    return layout.text_prefix + name


def k3train_name(hub_name: str, layout: HubLayout = K3_HUB) -> tuple[str, int | None]:
    """(k3train state-dict name, expert index or None) of a hub tensor name: the inverse of `hf_name`."""
    if hub_name == layout.lm_head:
        return "lm_head.weight", None
    if not layout.tensor_name.fullmatch(hub_name):
        raise HFConversionError(f"{hub_name} is not a tensor name of the {layout.title} text model")
    name = hub_name[len(layout.text_prefix) :]
    match = re.fullmatch(r"(layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.weight", name)
    if match:
        return f"{match.group(1)}.{match.group(3)}", int(match.group(2))
    for pair in _ATTN_RES_PAIRS:
        name = re.sub(rf"(^|\.){pair}_(norm|proj)\.weight$", rf"\1{pair}.\2.weight", name)
    return name, None


def hf_tensor_specs(
    config: ModelConfig, a_log_width: int | None = None, layout: HubLayout = K3_HUB
) -> list[TensorSpec]:
    """Every HF tensor of `config`, in file order (model-level first, layer by layer, head last).

    Routed experts are listed expert by expert (w1, w3, w2 of expert 0, then of expert 1, …), so
    a writer streaming in this order reads each stacked k3train tensor slab by slab. A tied head
    has no `language_model.lm_head.weight`. `a_log_width` (≥ num_heads) writes `A_log` zero-padded
    to that width, as the published checkpoint does with `head_dim`; the Kimi Linear layout writes
    it `[1, 1, H, 1]`.
    """
    heads = config.linear_attn_config.num_heads
    if a_log_width is not None and a_log_width < heads:
        raise ValueError(f"a_log_width ({a_log_width}) must be at least num_heads ({heads})")
    if a_log_width is not None and layout.a_log_4d:
        raise ValueError(f"the {layout.name} layout stores A_log as [1, 1, H, 1]: no padded width")
    specs: list[TensorSpec] = []
    shapes = k3_state_shapes(config)
    for k3_name in hf_file_order(list(shapes)):
        shape = shapes[k3_name]
        if k3_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if _K3_EXPERT_STACK.fullmatch(k3_name):
            continue  # emitted expert by expert below, at the place of the routed experts' input projection
        hf_shape = shape
        if k3_name.endswith("self_attn.A_log") and a_log_width is not None:
            hf_shape = (a_log_width,)
        elif k3_name.endswith("self_attn.A_log") and layout.a_log_4d:
            hf_shape = (1, 1, shape[0], 1)
        specs.append(TensorSpec(k3_name, hf_name(k3_name, layout=layout), hf_shape, shape, None, _keeps_fp32(k3_name)))
        # Routed experts follow the latent down-projection (the router without one).
        latent = config.routed_expert_hidden_size is not None
        if k3_name.endswith(
            "block_sparse_moe.routed_expert_down_proj.weight" if latent else "block_sparse_moe.gate.weight"
        ):
            stack = k3_name[: -len("routed_expert_down_proj.weight" if latent else "gate.weight")] + "experts."
            stacks = [(stack + w, layout.text_prefix + stack, w, shapes[stack + w]) for w in _EXPERT_WEIGHTS]
            for k3, _, _, _ in stacks:
                hf_name(k3, 0, layout)  # refuses a stack the hub has no name for
            for expert in range(config.num_experts):
                for k3, hf_stack, w, stacked in stacks:  # == hf_name(k3, expert), without the regexes
                    specs.append(TensorSpec(k3, f"{hf_stack}{expert}.{w}.weight", stacked[1:], stacked, expert))
    # Stacks are emitted at their layer's down-projection (router): a stack elsewhere would be left out.
    covered = {spec.k3_name for spec in specs} | ({"lm_head.weight"} if config.tie_word_embeddings else set())
    uncovered = [name for name in shapes if name not in covered]
    if uncovered:
        raise HFConversionError(f"the HF mapping does not cover these model tensors: {short_listing(uncovered)}")
    return specs


# ============================================================================ tensor values


def export_tensor(spec: TensorSpec, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The HF tensor of `spec` from the k3train tensor (the expert's slice already taken)."""
    if tuple(tensor.shape) != tuple(spec.k3_shape[1:] if spec.expert is not None else spec.k3_shape):
        raise HFConversionError(f"{spec.k3_name}: got shape {tuple(tensor.shape)}, expected {spec.k3_shape}")
    out = tensor.detach().to(spec.export_dtype(dtype))
    if spec.k3_name.endswith("self_attn.A_log") and len(spec.shape) == 4:
        out = out.reshape(spec.shape)
    elif spec.k3_name.endswith("self_attn.A_log") and spec.shape != spec.k3_shape:
        padded = torch.zeros(spec.shape, dtype=out.dtype)
        padded[: out.shape[0]] = out
        out = padded
    return out.contiguous()


def import_tensor(spec: TensorSpec, tensor: torch.Tensor) -> torch.Tensor:
    """The k3train tensor (the expert's slice for an expert spec) from an HF tensor, in its dtype.

    Only `A_log` has accepted variants: `[H]`, `[>= H]` with zero padding, and 4-D `[1, 1, H, 1]`.
    Any other shape difference raises `HFConversionError`.
    """
    want = spec.k3_shape[1:] if spec.expert is not None else spec.k3_shape
    shape = tuple(tensor.shape)
    if spec.k3_name.endswith("self_attn.A_log") and shape != want:
        heads = want[0]
        if len(shape) == 4 and shape[0] == shape[1] == shape[3] == 1 and shape[2] == heads:
            return tensor.reshape(heads)
        if len(shape) == 1 and shape[0] > heads:
            if torch.count_nonzero(tensor[heads:]).item():
                raise HFConversionError(
                    f"{spec.hf_name} has shape {list(shape)} for {heads} heads and its padding "
                    f"[{heads}:{shape[0]}) is not zero: cannot tell which entries are the heads"
                )
            return tensor[:heads]
    if shape != want:
        raise HFConversionError(f"{spec.hf_name} has shape {list(shape)}, the config implies {list(want)}")
    return tensor


def hf_shape_matches(spec: TensorSpec, shape: Sequence[int]) -> bool:
    """Whether an HF tensor of `shape` can be imported for `spec` (see `import_tensor`)."""
    shape = tuple(shape)
    want = spec.k3_shape[1:] if spec.expert is not None else spec.k3_shape
    if shape == want:
        return True
    if spec.k3_name.endswith("self_attn.A_log"):
        heads = want[0]
        return (len(shape) == 1 and shape[0] >= heads) or shape == (1, 1, heads, 1)
    return False


def bind_stored_names(available: Mapping[str, tuple[int, ...]], specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """`specs` with each `hf_name` spelled as the checkpoint stores it: a name the checkpoint
    lacks is replaced by an accepted alias it holds (`_STORED_ALIASES`), otherwise kept."""
    bound = []
    for spec in specs:
        name = spec.hf_name
        if name not in available:
            for pattern, replacement in _STORED_ALIASES:
                alias = pattern.sub(replacement, name) if pattern.fullmatch(name) else None
                if alias is not None and alias in available:
                    name = alias
                    break
        bound.append(spec if name == spec.hf_name else dataclasses.replace(spec, hf_name=name))
    return bound


def check_hf_tensors(
    available: Mapping[str, tuple[int, ...]],
    specs: Sequence[TensorSpec],
    source: str = "the checkpoint",
    layout: HubLayout = K3_HUB,
) -> list[str]:
    """Refuse a set of HF tensor names/shapes k3train cannot load; return the ignored names.

    Names outside the layout's text model (a vision tower, projectors) are ignored and returned.
    Raises `HFConversionError` for quantised experts, missing tensors, text tensors k3train has no
    place for (a low-rank KDA output gate under a full-rank config, say) and shape mismatches (one
    line, first few named). Pass specs through `bind_stored_names` first to accept aliases.
    """
    names = list(available)
    packed = [
        n for n in names if n.endswith((".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point"))
    ]
    if packed:
        raise HFConversionError(
            f"{source} holds quantised experts ({short_listing(packed)}): k3train loads unquantised weights "
            "only; dequantise the experts to BF16 (.weight tensors) first"
        )
    by_name = {spec.hf_name: spec for spec in specs}
    missing = [spec.hf_name for spec in specs if spec.hf_name not in available]
    if missing:
        raise HFConversionError(f"{source} lacks tensors the config implies: {short_listing(missing)}")
    text = [n for n in names if layout.is_text_tensor(n)]
    unexpected = [n for n in text if n not in by_name]
    # A KDA output gate of the other kind: g_a/g_b exist only in KDA; a g_proj is KDA's where the
    # config puts a low-rank gate (MLA's output gate is also called g_proj).
    gate_mismatch = [
        n
        for n in unexpected
        if re.search(r"self_attn\.(g_a|g_b)_proj\.weight$", n)
        or (n.endswith("self_attn.g_proj.weight") and n[: -len("g_proj.weight")] + "g_a_proj.weight" in by_name)
    ]
    if gate_mismatch:
        kind = "full-rank" if gate_mismatch[0].endswith("self_attn.g_proj.weight") else "low-rank"
        raise HFConversionError(
            f"{source} has a {kind} KDA output gate ({short_listing(gate_mismatch)}) the config does not "
            "imply: check linear_attn_config.use_full_rank_gate (k3train: linear_attn_config.output_gate)"
        )
    if unexpected:
        raise HFConversionError(
            f"{source} has text-model tensors k3train has no place for: {short_listing(unexpected)}"
        )
    wrong = []
    for name in text:
        spec, shape = by_name[name], tuple(available[name])
        if not hf_shape_matches(spec, shape):
            want = spec.k3_shape[1:] if spec.expert is not None else spec.k3_shape
            wrong.append(f"{name} {list(shape)} vs {list(want)}")
    if wrong:
        raise HFConversionError(f"{source} has tensors whose shape the config does not imply: {short_listing(wrong)}")
    return [n for n in names if not layout.is_text_tensor(n)]


def short_listing(items: Sequence[str], limit: int = 3) -> str:
    """The first `limit` items and how many there are in all (for one-line error messages)."""
    shown = ", ".join(items[:limit])
    return f"{shown}{', ...' if len(items) > limit else ''} ({len(items)} in all)" if len(items) > 1 else shown
