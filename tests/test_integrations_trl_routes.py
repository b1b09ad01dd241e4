"""attach(trainer, run) on a real TRL GRPOTrainer with a tiny Qwen3-MoE policy (built from a config): the
recorded trainer routes (format v1.3 `experts`, with full_routes=True) are the model's own router choices,
recomputed here with hooks on every `mlp.gate` at the weights and inputs the loss saw; the route of a
completion token is the one of the position that predicts it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kldiag
from kldiag.integrations import trl as kt

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from test_integrations_trl import train_keeping_first_batch  # noqa: E402
from trl_grpo import WORDS  # noqa: E402

LAYERS, K = 3, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<eos>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=8, num_experts_per_tok=K, mlp_only_layers=[0], max_position_embeddings=64,
                            tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _trainer(model_dir, out):
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast

    args = trl.GRPOConfig(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                          num_generations=4, max_completion_length=6, num_iterations=1, beta=0.0, max_steps=1,
                          logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True)
    prompts = [" ".join(WORDS[i % 20:i % 20 + 3]) for i in range(16)]
    return trl.GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **kw: [1.0] * len(completions),
                           args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
                           processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir))


def test_recorded_routes_are_the_models_own(moe_dir, tmp_path):
    trainer = _trainer(moe_dir, tmp_path / "out")
    run = tmp_path / "run"
    kt.attach(trainer, run, full_routes=True)
    state, inputs = train_keeping_first_batch(trainer)  # the weights and inputs the loss saw

    model = trainer.model
    model.load_state_dict(state)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    t = inputs["completion_ids"].shape[1]
    got = {}
    handles = [layer.mlp.gate.register_forward_hook(lambda m, a, o, i=i: got.__setitem__(i, o[2]))
               for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=att, output_router_logits=True)
    for h in handles:
        h.remove()
    assert sorted(got) == [1, 2] and len(out.router_logits) == 2  # layer 0 is dense
    want = np.full((*ids.shape, LAYERS, K), -1)
    for i, idx in got.items():
        want[:, :, i] = idx.reshape(*ids.shape, K).numpy()
    for i, logits in zip(sorted(got), out.router_logits, strict=True):  # the hook's indices: topk(softmax(logits))
        top = torch.topk(torch.softmax(logits.float(), -1), K, -1).indices.reshape(*ids.shape, K).numpy()
        assert np.array_equal(np.sort(top, -1), np.sort(want[:, :, i], -1))
    want = want[:, -t - 1:-1]  # the position that predicts each completion token

    table = kldiag.open_run(run).read(["step", "micro", "seq", "pos", "experts", "route_layers"]).to_pandas()
    first = table[(table["step"] == 1) & (table["micro"] == 0)]
    seqs, mask = inputs[kt.SEQ_KEY].numpy(), inputs["completion_mask"].bool().numpy()
    assert len(first) == mask.sum() and (first["route_layers"] == 2).all()
    for row in first.itertuples():
        b = int(np.flatnonzero(seqs == row.seq)[0])
        assert list(row.experts) == want[b, row.pos].ravel().tolist()
