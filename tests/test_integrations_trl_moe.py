"""attach(trainer, run, full_routes=True) on real TRL GRPOTrainer steps with MoE policies beyond Qwen3-MoE:

- a tiny DeepSeek-V3 (sigmoid + score-correction bias + grouped top-k, a dense first layer): the recorded
  `experts` are the ids each MoE block handed its experts at the weights and inputs the loss saw (an independent
  hook on `mlp.experts` here), the router margin columns are written, and the manifest says which side of the
  routes was captured (config["routes"]);
- a policy whose MoE blocks kldiag cannot read: one warning at attach naming the layers and module classes,
  and the manifest says so.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import kldiag
from kldiag.integrations import trl as kt

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_families as mf  # noqa: E402
from test_integrations_trl import train_keeping_first_batch  # noqa: E402
from trl_grpo import WORDS  # noqa: E402


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def _model(family: str, tokenizer):
    config = mf.tiny_config(family)
    config.vocab_size = len(tokenizer)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id, None
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _trainer(model, tokenizer, out):
    from datasets import Dataset

    args = trl.GRPOConfig(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                          num_generations=4, max_completion_length=6, num_iterations=1, beta=0.0, max_steps=1,
                          logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True)
    prompts = [" ".join(WORDS[i % 20:i % 20 + 3]) for i in range(16)]
    return trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [1.0] * len(completions), args=args,
                           train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer)


def test_deepseek_v3_routes_are_the_blocks_own_decision(tmp_path):
    tokenizer = _tokenizer()
    model = _model("deepseek_v3", tokenizer)
    trainer = _trainer(model, tokenizer, tmp_path / "out")
    run = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a capturable policy: no routes warning
        kt.attach(trainer, run, full_routes=True)
    state, inputs = train_keeping_first_batch(trainer)  # the weights and inputs the loss saw

    model = trainer.model
    model.load_state_dict(state)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    t = inputs["completion_ids"].shape[1]
    got = {}
    handles = [layer.mlp.experts.register_forward_pre_hook(lambda m, a, i=i: got.__setitem__(i, a[1]))
               for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=att)
    for h in handles:
        h.remove()
    assert sorted(got) == [1, 2]  # first_k_dense_replace=1: layer 0 is dense
    k = model.config.num_experts_per_tok
    want = np.full((*ids.shape, 3, k), -1)
    for i, idx in got.items():
        want[:, :, i] = idx.reshape(*ids.shape, k).numpy()
    want = want[:, -t - 1:-1]

    table = kldiag.open_run(run).read(["step", "micro", "seq", "pos", "experts", "route_layers",
                                       "route_margin_trainer", "route_margin_layer"]).to_pandas()
    first = table[(table["step"] == 1) & (table["micro"] == 0)]
    seqs, mask = inputs[kt.SEQ_KEY].numpy(), inputs["completion_mask"].bool().numpy()
    assert len(first) == mask.sum() and (first["route_layers"] == 2).all()
    for row in first.itertuples():
        b = int(np.flatnonzero(seqs == row.seq)[0])
        assert sorted(row.experts) == sorted(want[b, row.pos].ravel().tolist())
    assert first["route_margin_trainer"].notna().all() and set(first["route_margin_layer"]) <= {1, 2}
    routes = kldiag.open_run(run).manifest.config["routes"]
    assert routes["captured"] == "trainer" and "engine" in routes["missing"] and "uncaptured" not in routes


class OpaqueExperts(torch.nn.Module):
    """A user's own experts module: its routing comes in as an argument kldiag does not know."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, hidden_states, routing_map, routing_weights):
        return self.proj(hidden_states) * routing_weights.sum(-1, keepdim=True)


def test_a_policy_kldiag_cannot_capture_is_named_once_at_attach(tmp_path):
    tokenizer = _tokenizer()
    model = _model("qwen3_moe", tokenizer)
    for layer in model.model.layers:
        layer.mlp.experts = OpaqueExperts(model.config.hidden_size, layer.mlp.experts.num_experts)
    trainer = _trainer(model, tokenizer, tmp_path / "out")
    with pytest.warns(UserWarning, match="MoE layers whose routes kldiag cannot capture") as caught:
        rec = kt.attach(trainer, tmp_path / "run")
    message = [str(w.message) for w in caught if "cannot capture" in str(w.message)]
    assert len(message) == 1
    assert "layers 0, 1, 2 (model.layers.N.mlp.experts: OpaqueExperts" in message[0]
    assert "model.layers.N.mlp.gate: Qwen3MoeTopKRouter" in message[0]
    print(message[0])
    rec.close()
    routes = kldiag.open_run(tmp_path / "run").manifest.config["routes"]
    assert routes["captured"] == "none" and "OpaqueExperts" in routes["missing"]["trainer"]
    assert routes["uncaptured"]["model.layers.1.mlp.experts"] == "OpaqueExperts"
