"""The TRL hook's per-batch kernels: one compiled pass for its log metrics (trl_metrics.batch_partials),
and the trainer's top-k at the loss's own forward (`TopkCapture`, attach(topk=k)).

Per-token maths is that of kldiag.estimators (docs/metrics.md, "Per-token estimators"), in float64:

    d = logp_ref - logp    rho = exp(logp - logp_old)    k3 = expm1(d) - d    |weight_k3| = |expm1(d)|
    k3_is = rho * k3 (DeepSeek-V3.2 eq. 7)    weight_k3_is = rho * (logp - logp_ref) (eq. 9)

with estimators._nan_to_inf_product's rule for 0 * inf, and NaN values left out of sums and
maxima. numpy would spend some thirty array operations on this; on the hook's micro-batches
(a few hundred tokens) their per-call cost, paid while holding the GIL beside the training
thread, was the bulk of the writer's CPU. Compiled once and cached on disk; releases the GIL.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import numpy as np

from kldiag import estimators as E
from kldiag.jit import njit

JIT = dict(cache=True, nogil=True, error_model="numpy")
LOG_TAU = math.log(E.TAU)


@njit(inline="always", **JIT)
def product(a, b):
    """a * b; a NaN from 0 * inf of non-NaN factors is +-inf (estimators._nan_to_inf_product)."""
    out = a * b
    if math.isnan(out) and not math.isnan(a) and not math.isnan(b):
        sign = (math.copysign(1.0, a) if math.isinf(a) else 1.0) * (math.copysign(1.0, b) if math.isinf(b) else 1.0)
        return sign * math.inf
    return out


@njit(**JIT)
def partials_kernel(s, r, o, u, keep, has_ref):
    """Sums, maxima and counts over the tokens where `keep`; inputs [N]: s, r, o, u (logp, logp_ref,
    logp_old, logp_sampler; a missing one is passed as s) of one float dtype (float32 is widened as
    it is read), keep bool.

    Returns (f, c): f = k3_sum, k3_is_sum, weight_k3_abs_sum, weight_k3_abs_flagged_sum,
    weight_k3_abs_max, weight_k3_is_abs_max, rho_max; c = tokens, flagged, nonfinite
    (trl_metrics._KERNEL_F / _KERNEL_I). Without a reference (has_ref False) only rho_max,
    tokens and nonfinite (of logp, logp_old and logp_sampler) are filled. A token is flagged as
    kldiag.estimators.flagged says: the sampler's NaN/inf or positive log-prob counts too.
    """
    f = np.zeros(7)
    c = np.zeros(3, np.int64)
    for i in range(s.size):
        if not keep[i]:
            continue
        # float(x) of a float32 stays float32 in numba; the maths is float64, as in estimators.
        si, oi, ri, ui = np.float64(s[i]), np.float64(o[i]), np.float64(r[i]), np.float64(u[i])
        c[0] += 1
        rho = math.exp(si - oi)
        if rho > f[6]:  # rho >= 0: a max from 0 equals the max of the non-NaN values (0 if none)
            f[6] = rho
        finite = math.isfinite(si) and math.isfinite(oi) and math.isfinite(ui) and (not has_ref or math.isfinite(ri))
        if not finite:
            c[2] += 1
        if not has_ref:
            continue
        d = ri - si
        em1 = math.expm1(d)
        k3 = math.inf if d == math.inf else em1 - d
        w = abs(em1)
        flagged = (d > LOG_TAU or w > E.WEIGHT_LIMIT or k3 > E.CLAMP or not finite
                   or si > 0 or ri > 0 or oi > 0 or ui > 0)  # > 0 of +inf is also nonfinite: the union is unchanged
        k3_is = product(rho, k3)
        w_is = abs(product(rho, -d))
        if not math.isnan(k3):
            f[0] += k3
        if not math.isnan(k3_is):
            f[1] += k3_is
        if not math.isnan(w):
            f[2] += w
            if flagged:
                f[3] += w
            if w > f[4]:
                f[4] = w
        if w_is > f[5]:
            f[5] = w_is
        if flagged:
            c[1] += 1
    return f, c


# ---- the trainer's top-k (attach(..., topk=k)) ------------------------------------------------

TOPK_CHUNK = 1 << 26  # logits per projection chunk (tokens x vocabulary): 256 MB in float32
TOPK_CHECK_NATS = 0.05  # |our log-prob of the label - TRL's| above this: the top-k is not TRL's distribution


class TopkCapture:
    """While open, a forward hook on the policy's backbone turns the last hidden states of each
    chunk TRL scores into the top-k token ids and log-probs of the distribution TRL's log-probs
    come from, at the completion tokens only.

    TRL 1.16 scores completions with a fused LM head (trl/trainer/utils.py `add_fused_lm_head`,
    trl/kernels/chunked_logprob.py): the `[B, T, V]` logits never exist. So the hook projects the
    completion positions' hidden states through the LM head itself (no grad, `TOPK_CHUNK` logits at a
    time), with the model config's `logit_scale` and `final_logit_softcapping` and TRL's temperature,
    then torch.topk and a logsumexp: one more LM-head projection of the completion tokens, the cost
    of attach(topk=k) (bench/topk.py). Completion token t of the chunk is predicted at hidden
    position -logits_to_keep - 1 + t, as in the fused head (hidden[:, :-1] against labels[:, 1:]).

    The capture never waits for the device: every position is projected (chunks sized from shapes,
    which the host knows) and the padding positions are masked afterwards with `torch.where`, where
    selecting the valid rows first (`nonzero`) would sync. The projection and the top-k run in the
    model's dtype (scale, softcap and temperature are increasing, so they keep the order); only the
    k chosen logits and the log-sum-exp are taken in float32. With `check` (the first call), the
    labels' log-probs are kept too and `result` returns the largest |ours - TRL's|: a model whose
    logits are scaled by something else (another config key) shows there rather than in silently
    wrong lists.
    """

    def __init__(self, model: Any, k: int, temperature: float, logits_to_keep: int, check: bool = True):
        self.k, self.temperature, self.keep, self.check = int(k), float(temperature), int(logits_to_keep), check
        self.head = model.get_output_embeddings()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.scale = getattr(config, "logit_scale", None) or 1.0
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.parts: list[tuple[Any, Any, Any, Any]] = []  # per chunk: ids, logp [b, T, k], label logp, valid
        self.handle = model.base_model.register_forward_hook(self._hook, with_kwargs=True)

    @classmethod
    def around(cls, trainer: Any, k: int, method: Any, args: tuple, kwargs: dict, check: bool = True) -> TopkCapture:
        """A capture for one call of trainer._get_per_token_logps_and_entropies(*args, **kwargs)."""
        bound = inspect.signature(method).bind(*args, **kwargs).arguments
        model = trainer.accelerator.unwrap_model(bound["model"])
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
        return cls(model, k, getattr(trainer, "temperature", 1.0), bound["logits_to_keep"], check)

    def close(self) -> None:
        self.handle.remove()

    def _hook(self, module, args, kwargs, output) -> None:
        import torch

        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        ids = kwargs.get("input_ids", args[0] if args else None)
        att = kwargs.get("attention_mask")
        with torch.no_grad():
            h = hidden[:, -self.keep - 1:-1].to(self.head.weight.device)
            b, t = h.shape[:2]
            valid = torch.ones((b, t), dtype=torch.bool, device=h.device) if att is None \
                else att[:, -self.keep:].to(h.device).bool()
            labels = ids[:, -self.keep:].to(h.device).reshape(-1) if self.check else None
            flat = h.reshape(b * t, h.shape[-1])
            rows = max(1, TOPK_CHUNK // self.head.weight.shape[0])
            got = [self._chunk(flat[s:s + rows], None if labels is None else labels[s:s + rows])
                   for s in range(0, b * t, rows)]
            keep = valid.unsqueeze(-1)
            top_ids = torch.where(keep, torch.cat([g[0] for g in got]).view(b, t, -1), -1)
            top_logp = torch.where(keep, torch.cat([g[1] for g in got]).view(b, t, -1), -math.inf)
            label_logp = torch.cat([g[2] for g in got]).view(b, t) if self.check else None
        self.parts.append((top_ids, top_logp, label_logp, valid))

    def _chunk(self, h: Any, labels: Any | None) -> tuple[Any, Any, Any | None]:
        """One chunk of positions [n, H]: top-k ids [n, k] (long), their log-probs [n, k] and, with
        labels, the labels' log-probs [n] (float32)."""
        import torch

        raw = self.head(h)  # [n, V] in the model's dtype
        monotone = self.scale > 0
        v, i = torch.topk(raw if monotone else self._tempered(raw.float()), min(self.k, raw.shape[-1]), dim=-1)
        z = self._tempered(raw.float())
        log_z = torch.logsumexp(z, dim=-1, keepdim=True)
        top = (self._tempered(v.float()) if monotone else v) - log_z
        label = None if labels is None else (z.gather(-1, labels.unsqueeze(-1)) - log_z).squeeze(-1)
        return i, top, label

    def _tempered(self, z: Any) -> Any:
        """Raw LM-head logits -> the tempered logits TRL's log-probs are the log_softmax of (float32)."""
        import torch

        z = z * self.scale
        if self.softcap:
            z = self.softcap * torch.tanh(z / self.softcap)
        return z / self.temperature

    def result(self, logp: Any, check: bool) -> tuple[Any, Any, float | None]:
        """(ids int32, log-probs float32) [B, T, k] of every chunk, and with `check` (a device sync;
        only when the capture was opened with check) the largest |label log-prob - TRL's [B, T]
        `logp`| at the completion tokens, else None."""
        import torch

        ids = torch.cat([p[0] for p in self.parts]).to(torch.int32)
        top = torch.cat([p[1] for p in self.parts])
        if not (check and self.check):
            return ids, top, None
        label, valid = torch.cat([p[2] for p in self.parts]), torch.cat([p[3] for p in self.parts])
        gap = (label - logp.detach().to(label.device).float())[valid].abs()
        return ids, top, float(gap.max()) if gap.numel() else 0.0
