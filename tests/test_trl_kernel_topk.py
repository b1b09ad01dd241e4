"""kldiag.integrations.trl.kernel.TopkCapture on its own: the lists it takes from the backbone's
hidden states equal the top-k of the log_softmax of the model's own (tempered, scaled, soft-capped)
logits, padding positions masked, in float32 and bfloat16, over chunk boundaries; and on a CUDA
device the capture never syncs (torch.cuda.set_sync_debug_mode("error"); skipped without a GPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kldiag.integrations.trl import kernel as trl_kernel  # noqa: E402

K, KEEP, TEMP = 5, 6, 0.7


def tiny_lm(dtype: torch.dtype, device: str = "cpu", softcap: float | None = None):
    config = transformers.Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(dtype=dtype, device=device).eval()
    if softcap:
        model.config.final_logit_softcapping = softcap
    return model


def batch(device: str = "cpu"):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (3, 14), generator=gen)
    att = torch.ones_like(ids)
    att[1, -2:] = 0  # right padding in the completion
    att[2, :3] = 0  # left padding in the prompt
    return ids.to(device), att.to(device)


def reference(model, ids, att, softcap):
    with torch.no_grad():
        z = model(input_ids=ids, attention_mask=att).logits[:, -KEEP - 1:-1].float()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z / TEMP, -1)
    top, top_ids = torch.topk(logp, K, dim=-1)
    label = logp.gather(-1, ids[:, -KEEP:].unsqueeze(-1)).squeeze(-1)
    return top, top_ids, label


def capture(model, ids, att, check=True):
    cap = trl_kernel.TopkCapture(model, K, TEMP, KEEP, check=check)
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=att)
    finally:
        cap.close()
    return cap


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_capture_is_the_models_top_k(monkeypatch, dtype, tol, softcap):
    monkeypatch.setattr(trl_kernel, "TOPK_CHUNK", 97 * 4)  # 4 positions a chunk: 18 positions, 5 chunks
    model = tiny_lm(dtype, softcap=softcap)
    ids, att = batch()
    top, top_ids, label = reference(model, ids, att, softcap)
    cap = capture(model, ids, att)
    got_ids, got, check = cap.result(label, check=True)
    valid = att[:, -KEEP:].bool()
    assert got_ids.dtype == torch.int32 and got.dtype == torch.float32 and got.shape == (3, KEEP, K)
    assert torch.all(got_ids[~valid] == -1) and torch.all(torch.isneginf(got[~valid]))
    assert torch.allclose(got[valid], top[valid], atol=tol, rtol=0)
    # ids: equal where the reference's values are not tied at the dtype's precision
    distinct = (top[valid][:, 1:] - top[valid][:, :-1]).abs().min(-1).values > 2 * tol
    assert torch.equal(got_ids[valid][distinct].long(), top_ids[valid][distinct])
    assert check < tol


def test_without_check_no_label_is_kept():
    model = tiny_lm(torch.float32)
    ids, att = batch()
    cap = capture(model, ids, att, check=False)
    assert cap.parts[0][2] is None
    _, _, check = cap.result(torch.zeros(3, KEEP), check=True)
    assert check is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_capture_never_syncs_the_device():
    """The backbone's forward runs first (a model's own mask handling may sync); then the capture's
    hook and result on its output, under sync debug mode "error"."""
    model = tiny_lm(torch.bfloat16, "cuda")
    ids, att = batch("cuda")
    with torch.no_grad():
        out = model.model(input_ids=ids, attention_mask=att)
    cap = trl_kernel.TopkCapture(model, K, TEMP, KEEP, check=False)
    cap.close()  # driven by hand below
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cap._hook(model.model, (), {"input_ids": ids, "attention_mask": att}, out)
        got_ids, got, _ = cap.result(None, check=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    top, top_ids, _ = reference(model, ids, att, None)
    valid = att[:, -KEEP:].bool()
    assert got_ids.is_cuda and torch.allclose(got[valid], top[valid], atol=2e-2, rtol=0)
