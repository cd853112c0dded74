"""K3 exports run in transformers with the bundled remote code: `to-hf` writes
`configuration_kimi_k3.py`/`modeling_kimi_k3.py` and `auto_map`, and
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` loads every tensor and
computes `tools/score.py`'s logits within 1e-5 in fp32 (Block and Full AttnRes, plain residuals;
sequence lengths inside, at and across k3train's KDA chunks of 16; float64 within 1e-9) and its
greedy continuation through `generate()` with the cache (prefill chunkwise, then one recurrent
KDA step per token). An export with `--pad-a-log` loads as well."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal, cast

import pytest
import torch

from k3train.model.config import LinearAttnConfig, ModelConfig
from tests.unit.test_hf_conversion import CHECKOUT, _load_tool, _save_run, convert

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

score = _load_tool("score")
LENGTHS = (5, 16, 17, 40)  # inside the first chunk of 16, exactly one, across one boundary, across two
TOLERANCE = 1e-5
REMOTE = CHECKOUT / "k3train" / "checkpoint" / "hf_remote"


def _model_config(attn_res: Literal["block", "full", "none"]) -> ModelConfig:
    return ModelConfig(attn_res=attn_res, linear_attn_config=LinearAttnConfig(chunk_size=16))


def _export(root: Path, attn_res: Literal["block", "full", "none"], *options: str) -> Path:
    _save_run(root / "run", _model_config(attn_res))
    assert (
        convert.main(
            ["to-hf", "--load", str(root / "run"), "--out", str(root / "hf"), "--dtype", "fp32", "--quiet", *options]
        )
        == 0
    )
    return root / "hf"


def _score(root: Path, tokens: torch.Tensor, dtype: str = "fp32") -> torch.Tensor:
    """k3train's logits of `tokens` as `tools/score.py` writes them (the run's checkpoint)."""
    (root / "tokens.json").write_text(json.dumps(tokens.tolist()))
    assert (
        score.main(
            [
                "--load",
                str(root / "run"),
                "--tokens-file",
                str(root / "tokens.json"),
                "--out",
                str(root / "logits.json"),
                "--dtype",
                dtype,
            ]
        )
        == 0
    )
    return torch.tensor(json.loads((root / "logits.json").read_text())["logits"])


def remote_module(model):
    """The module transformers loaded the remote code as."""
    return sys.modules[type(model).__module__]


def _load_remote(path: Path):
    loaded = AutoModelForCausalLM.from_pretrained(
        str(path), trust_remote_code=True, dtype=torch.float32, output_loading_info=True
    )
    # with output_loading_info, (model, info): transformers' annotation gives the model alone
    model, info = cast(tuple[Any, dict[str, Any]], loaded)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.parametrize("attn_res", ["block", "full", "none"])
def test_remote_code_export_computes_k3train_logits_and_greedy_decode(attn_res, tmp_path):
    hf = _export(tmp_path, attn_res)
    config = json.loads((hf / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_kimi_k3.KimiK3ForCausalLM"
    remote = _load_remote(hf)
    k3, _ = score.load_model(str(tmp_path / "run"))
    k3.eval()
    for i, length in enumerate(LENGTHS):
        tokens = torch.randint(0, 384, (2, length), generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            fp32 = (remote(input_ids=tokens).logits - _score(tmp_path, tokens)).abs().max().item()
            fp64 = (remote.double()(input_ids=tokens).logits - k3.double()(tokens)).abs().max().item()
        remote.float(), k3.float()
        print(
            f"remote K3 ({attn_res}), T={length}: max abs logit difference to score.py fp32 {fp32:.3g}, fp64 {fp64:.3g}"
        )
        assert fp32 <= TOLERANCE and fp64 <= 1e-9, (length, fp32, fp64)

    # A prompt in two pieces through the cache (the second chunkwise from the cached KDA state),
    # split inside a chunk: the chunk edges move, so the algorithm is checked in float64.
    with torch.no_grad():
        remote.double()
        whole = remote(input_ids=tokens).logits
        first = remote(input_ids=tokens[:, :9], use_cache=True)
        cache = getattr(first, remote_module(remote).CACHE_FIELD)  # `cache` (transformers ≥ 5.24) or `past_key_values`
        assert isinstance(cache, transformers.Cache)
        second = remote(input_ids=tokens[:, 9:], past_key_values=cache, use_cache=True)
        remote.float()
    pieces = (torch.cat([first.logits, second.logits], dim=1) - whole).abs().max().item()
    print(
        f"remote K3 ({attn_res}), T={tokens.shape[1]} in pieces 9 + {tokens.shape[1] - 9} through the cache: "
        f"max abs logit difference fp64 {pieces:.3g}"
    )
    assert pieces <= 1e-9, pieces

    prompt = torch.randint(0, 384, (1, 7), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        generated = remote.generate(
            prompt, max_new_tokens=DECODE_STEPS, do_sample=False, return_dict_in_generate=True, output_logits=True
        )
        tokens = generated.sequences
        # k3train's greedy decode: the whole sequence each step, no cache (chunkwise KDA)
        full_fp32 = [k3(tokens[:, : prompt.shape[1] + i])[:, -1] for i in range(DECODE_STEPS)]
        assert torch.equal(tokens[:, prompt.shape[1] :], torch.stack([s.argmax(-1) for s in full_fp32], dim=1))
        k3.double(), remote.double()
        truth = [k3(tokens[:, : prompt.shape[1] + i])[:, -1] for i in range(DECODE_STEPS)]
        cached_fp64 = _decode_through_cache(remote, tokens, prompt.shape[1])
        k3.float(), remote.float()
    # float64: the cached steps (one recurrent KDA step, MLA keys/values appended) are the same
    # algorithm as the chunkwise recomputation, so they agree to float64 rounding.
    algorithm = _max_difference(cached_fp64, truth)
    # fp32: generate()'s cached logits and k3train's own full recomputation each carry fp32's forward
    # error, measured against the float64 truth and held to the worst-case rounding bound.
    bound = fp32_forward_error_bound(_model_config(attn_res), tokens.shape[1], max(t.abs().max().item() for t in truth))
    cached_error, full_error = _max_difference(generated.logits, truth), _max_difference(full_fp32, truth)
    print(
        f"remote K3 ({attn_res}): generate() of {DECODE_STEPS} greedy tokens equals k3train's; cached steps "
        f"against the float64 recomputation: fp64 {algorithm:.3g}, fp32 {cached_error:.3g} (k3train's own fp32 "
        f"{full_error:.3g}; worst-case bound {bound:.3g})"
    )
    assert algorithm <= 1e-9, algorithm
    assert cached_error <= bound and full_error <= bound, (cached_error, full_error, bound)


DECODE_STEPS = 20
UNIT_ROUNDOFF_FP32 = 2.0**-24


def fp32_forward_error_bound(config: ModelConfig, length: int, scale: float) -> float:
    """Worst-case fp32 error of a logit: gamma_n = n u with n the summed lengths of the dot
    products one logit depends on in sequence (per layer: the input projection, a head's q.k, the
    sum over positions, the output projection, the router/latent projection and the expert GLU's
    three GEMMs; then the LM head), times the logits' magnitude (the norms keep the layers' inputs
    at unit scale, so errors do not grow by more than the logits' size between layers)."""
    kda = config.linear_attn_config
    heads_width = max(kda.num_heads * kda.head_dim, config.num_attention_heads * config.v_head_dim)
    expert_width = config.routed_expert_hidden_size or config.hidden_size
    per_layer = (
        config.hidden_size
        + kda.head_dim
        + length
        + heads_width
        + config.hidden_size
        + expert_width
        + config.moe_intermediate_size
        + expert_width
    )
    terms = config.num_hidden_layers * per_layer + config.hidden_size
    return terms * UNIT_ROUNDOFF_FP32 * scale


def _decode_through_cache(remote, tokens: torch.Tensor, prompt_length: int) -> list[torch.Tensor]:
    """Greedy decoding's forwards written out (as a manual decode loop does): the prompt
    chunkwise, then one token per call through the cache; the last position's logits per step."""
    output = remote(input_ids=tokens[:, :prompt_length], use_cache=True)
    logits = [output.logits[:, -1]]
    for end in range(prompt_length + 1, tokens.shape[1]):
        output = remote(  # the new token only, as a manual decode loop passes it
            input_ids=tokens[:, end - 1 : end],
            past_key_values=getattr(output, remote_module(remote).CACHE_FIELD),
            use_cache=True,
        )
        logits.append(output.logits[:, -1])
    return logits


def _max_difference(first, second) -> float:
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(first, second))


def test_remote_code_needs_no_k3train():
    for name in convert.REMOTE_CODE_FILES:
        tree = ast.parse((REMOTE / name).read_text())
        modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not [m for m in modules if m.startswith("k3train")], (name, modules)


def test_remote_code_loads_an_export_with_a_padded_a_log(tmp_path):
    """`--pad-a-log` writes A_log as [head_dim] (zero-padded past the heads); config.json records
    the shape, so the remote model declares it and reads the heads' rates from its first entries."""
    hf = _export(tmp_path, "block", "--pad-a-log")
    config = json.loads((hf / "config.json").read_text())
    head_dim = config["text_config"]["linear_attn_config"]["head_dim"]
    assert config["text_config"]["linear_attn_config"]["a_log_shape"] == [head_dim]
    remote = _load_remote(hf)
    assert tuple(remote.language_model.model.layers[0].self_attn.A_log.shape) == (head_dim,)
    tokens = torch.randint(0, 384, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        difference = (remote(input_ids=tokens).logits - _score(tmp_path, tokens)).abs().max().item()
    print(f"remote K3 (block, --pad-a-log), T=17: max abs logit difference to score.py fp32 {difference:.3g}")
    assert difference <= TOLERANCE


def test_remote_code_loads_and_generates_with_k3train_unimportable(tmp_path):
    """A user's machine without k3train: `import k3train` fails in a fresh interpreter, the export
    still loads with trust_remote_code and generates."""
    hf = _export(tmp_path, "block")
    script = (
        "import sys; sys.modules['k3train'] = None\n"  # any `import k3train…` now raises ImportError
        "import torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(hf)!r}, trust_remote_code=True, dtype=torch.float32)\n"
        "out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)\n"
        "assert not [m for m in sys.modules if m.startswith('k3train.')], 'k3train was imported'\n"
        "print('generated', out.shape[1])\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "generated 7" in result.stdout, result.stderr[-2000:]
