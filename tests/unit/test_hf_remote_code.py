"""K3 exports run in transformers with the bundled remote code: `to-hf` writes
`configuration_kimi_k3.py`/`modeling_kimi_k3.py` and `auto_map`, and
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` loads every tensor and
computes k3train's logits (Block and Full AttnRes, plain residuals; sequence lengths across
k3train's KDA chunks of 16) and its greedy continuation through `generate()` with the cache.

The remote model runs the KDA recurrence token by token, k3train the chunkwise kernel: the same
math, different fp32 rounding. k3train's own fp32 logits move by ~3e-5 between chunk sizes 16
and 64 on this randomised model, so the algorithms are held together in float64 (≤ 1e-9), and
fp32 is bounded at that noise level (≤ 5e-4, printed)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from k3train.model.config import LinearAttnConfig, ModelConfig
from tests.unit.test_hf_conversion import CHECKOUT, _load_tool, _save_run, convert

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

score = _load_tool("score")
LENGTHS = (5, 17, 40)  # inside the first chunk of 16, across one boundary, across two
REMOTE = CHECKOUT / "k3train" / "checkpoint" / "hf_remote"


def _export(root: Path, attn_res: str) -> Path:
    config = ModelConfig(attn_res=attn_res, linear_attn_config=LinearAttnConfig(chunk_size=16))
    _save_run(root / "run", config)
    assert convert.main(["to-hf", "--load", str(root / "run"), "--out", str(root / "hf"), "--dtype", "fp32",
                         "--quiet"]) == 0
    return root / "hf"


def _load_remote(path: Path):
    model, info = AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True, dtype=torch.float32,
                                                       output_loading_info=True)
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
            fp32 = (remote(input_ids=tokens).logits - k3(tokens)).abs().max().item()
            fp64 = (remote.double()(input_ids=tokens).logits - k3.double()(tokens)).abs().max().item()
        remote.float(), k3.float()
        print(f"remote K3 ({attn_res}), T={length}: max abs logit difference fp32 {fp32:.3g}, fp64 {fp64:.3g}")
        assert fp64 <= 1e-9 and fp32 <= 5e-4, (length, fp32, fp64)

    prompt = torch.randint(0, 384, (1, 7), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        generated = remote.generate(prompt, max_new_tokens=20, do_sample=False)
        tokens = prompt
        for _ in range(20):  # k3train's greedy decode: the whole sequence each step, no cache
            tokens = torch.cat([tokens, k3(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    print(f"remote K3 ({attn_res}): generate() of 20 greedy tokens equals k3train: {torch.equal(generated, tokens)}")
    assert torch.equal(generated, tokens)


def test_remote_code_needs_no_k3train():
    for name in ("configuration_kimi_k3.py", "modeling_kimi_k3.py"):
        tree = ast.parse((REMOTE / name).read_text())
        modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not [m for m in modules if m.startswith("k3train")], (name, modules)
