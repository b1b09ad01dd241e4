"""attach(trainer, run, topk=k) on a real TRL GRPOTrainer (the tiny CPU model of
tests/test_integrations_trl.py): the recorded topk_ids/topk_logp are the top-k of the log_softmax of
the model's own logits (recomputed here with the unfused forward, at the weights the loss saw)."""

from __future__ import annotations


import numpy as np
import pytest
import torch

import kldiag
from kldiag.errors import IntegrationError
from kldiag.integrations import trl as kt

pytestmark = pytest.mark.slow

from test_integrations_trl import make_trainer, tiny_model_dir, train_keeping_first_batch  # noqa: E402, F401 - the module's fixture

K = 4


def test_topk_columns_are_the_models_top_k(tiny_model_dir, tmp_path):  # noqa: F811
    trainer = make_trainer(tiny_model_dir, tmp_path / "out", max_steps=1, num_iterations=1,
                           gradient_accumulation_steps=1, beta=0.0)
    with pytest.raises(IntegrationError, match="topk"):
        kt.attach(trainer, tmp_path / "bad", topk=0)
    run = tmp_path / "run"
    kt.attach(trainer, run, topk=K)
    state, inputs = train_keeping_first_batch(trainer)  # the weights and inputs the loss saw
    assert trainer._kldiag_hook.topk_check < 1e-4  # our label log-probs are TRL's

    model = trainer.model  # not a deepcopy: TRL's patched forward calls the original model's unfused one
    model.load_state_dict(state)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    t = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=att).logits[:, -t - 1:-1].float()
    want_logp, want_ids = torch.topk(torch.log_softmax(logits / trainer.temperature, -1), K, dim=-1)

    table = kldiag.open_run(run).read(["step", "micro", "seq", "pos", "topk_ids", "topk_logp"]).to_pandas()
    first = table[(table["step"] == 1) & (table["micro"] == 0)]
    seqs = inputs[kt.SEQ_KEY].numpy()
    mask = inputs["completion_mask"].bool().numpy()
    assert len(first) == mask.sum()
    for row in first.itertuples():
        b = int(np.flatnonzero(seqs == row.seq)[0])
        assert mask[b, row.pos]
        assert list(row.topk_ids) == want_ids[b, row.pos].tolist()
        np.testing.assert_allclose(row.topk_logp, want_logp[b, row.pos].numpy(), atol=1e-5)
    assert table["topk_ids"].map(len).eq(K).all()
