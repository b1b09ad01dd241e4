"""Route capture on every MoE family of the installed transformers (kldiag/integrations/common/moe_capture.py,
trl_routes.RoutesCapture): a tiny random model of each family (tests/moe_families.py), one plain forward with
the capture on, and the recorded routes compared, as sets per (token, layer), with what each block hands its
experts, read by an independent hook here (the `experts` module's id argument, or the family's own routing
computation where the experts take no ids). A family that cannot be built is skipped with its reason.

`python tests/test_moe_families.py` prints the family table (family, module class captured, captured, share of
(token, layer) expert sets equal, dense layers, notes).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_families as mf  # noqa: E402

from kldiag.integrations.common.moe_capture import find_sources, index_param, layer_margin, layer_of  # noqa: E402
from kldiag.integrations.trl.routes import RoutesCapture  # noqa: E402

B, S = 2, 9


def _expected_hooks(model, want: dict[int, list]):
    """Independent of kldiag's detection: per layer, the ids the block hands its experts."""
    handles = []
    for name, module in model.named_modules():
        where, leaf = layer_of(name), name.rpartition(".")[2]
        if where is None:
            continue
        layer = where[1]
        if leaf == "experts" and index_param(module) is not None and "attention" not in name:
            def pre(m, args, kwargs, layer=layer):
                want.setdefault(layer, []).append(kwargs.get("top_k_index", args[1] if len(args) > 1 else None))
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        elif type(module).__name__ == "Llama4Router":  # its scores are zero outside topk(logits)
            handles.append(module.register_forward_hook(
                lambda m, a, o, layer=layer: want.setdefault(layer, []).append(torch.topk(o[1], m.top_k, -1).indices)))
        elif type(module).__name__ == "JetMoeTopKGating" and ".mlp." in name:  # logits.topk(top_k) (its forward)
            handles.append(module.register_forward_hook(
                lambda m, a, o, layer=layer: want.setdefault(layer, []).append(o[4].topk(m.top_k, dim=1).indices)))
        elif type(module).__name__ == "DogeCDMoE":  # product-key top-k from its router logits (its forward)
            handles.append(module.register_forward_hook(
                lambda m, a, o, layer=layer: want.setdefault(layer, []).append(_doge_ids(m, o[1]))))
    return handles


def _doge_ids(m, router_logits):
    (sx, sy), (ix, iy) = router_logits.topk(m.num_keys, dim=-1)
    scores = (sx.unsqueeze(-1) + sy.unsqueeze(-2)).flatten(-2)
    ids = (ix.unsqueeze(-1) * m.num_keys + iy.unsqueeze(-2)).flatten(-2)
    return ids.gather(-1, scores.topk(m.top_k, dim=-1).indices)


def run_family(family: str) -> dict:
    """Build, forward with the capture and the independent hooks, compare. A dict for the table."""
    model, why = mf.build(family)
    if model is None:
        return {"family": family, "built": False, "notes": why}
    layout = find_sources(model)
    row = {"family": family, "built": True, "model": type(model).__name__, "layers": layout.layers,
           "classes": sorted({type(s.module).__name__ for s in layout.sources.values()}),
           "kinds": sorted({s.kind for s in layout.sources.values()}), "uncaptured": layout.uncaptured}
    want: dict[int, list] = {}
    handles = _expected_hooks(model, want)
    cap = RoutesCapture(model, S - 1, layout)
    cap.shape = (B, S)
    torch.manual_seed(1)
    ids = torch.randint(3, 120, (B, S))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    except Exception as e:  # noqa: BLE001 - the table's note
        row.update(forward=False, notes=f"forward: {type(e).__name__}: {str(e)[:140]}")
        return row
    finally:
        cap.close()
        for h in handles:
            h.remove()
    got = cap.result().numpy() if cap.chunks else np.zeros((B, S - 1, layout.layers, 1), np.int64) - 1
    margin = cap.margin()
    expected = {layer: torch.cat([p.reshape(-1, p.shape[-1]) for p in parts]).reshape(B, S, -1)[:, :-1].numpy()
                for layer, parts in want.items()}
    equal = total = 0
    for layer, e in expected.items():
        g = got[:, :, layer, : e.shape[-1]] if layer < got.shape[2] else None
        for t in np.ndindex(e.shape[:2]):
            total += 1
            same = g is not None and set(g[t].tolist()) == set(e[t].tolist())
            equal += same and (got[t][layer] >= 0).sum() == e.shape[-1]
    dense = [i for i in range(got.shape[2]) if (got[:, :, i] < 0).all()]
    row.update(forward=True, expected_layers=sorted(expected), captured_layers=sorted(cap.chunks),
               share_equal=equal / total if total else float("nan"), dense=dense,
               dense_ok=dense == [i for i in range(got.shape[2]) if i not in expected], k=got.shape[-1],
               margin_median=None if margin is None else float(np.nanmedian(margin[0].numpy())),
               notes=NOTES.get(family, ""))
    return row


NOTES = {
    "deepseek_v3": "sigmoid + score-correction bias + grouped top-k: the block's own decision",
    "glm4_moe": "sigmoid + score-correction bias + grouped top-k: the block's own decision",
    "deepseek_v4": "hash-routed layers (tid2eid) recorded as routed with their ids",
    "jetmoe": "MoE MLP routes; the mixture-of-attention router is not recorded",
    "llama4": "dense scores zero outside the chosen experts",
    "doge": "product-key experts: ids the embedding experts are indexed by",
    "dbrx": "routers under transformer.blocks.N",
    "aria": "k from the module (moe_topk)",
}
FAMILIES = mf.families()


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_routes_are_what_each_block_hands_its_experts(family):
    row = run_family(family)
    if not row["built"]:
        pytest.skip(f"{family} cannot be built from a tiny config: {row['notes']}")
    if not row.get("forward"):
        pytest.skip(f"{family}: a tiny model's forward fails in transformers itself: {row['notes']}")
    assert not row["uncaptured"], f"MoE modules without a captured route: {row['uncaptured']}"
    assert row["expected_layers"], "no MoE block handed its experts ids"
    assert row["captured_layers"] == row["expected_layers"]
    assert row["share_equal"] == 1.0
    assert row["dense_ok"], f"dense layers {row['dense']} against expected routed {row['expected_layers']}"
    if family == "aria":  # k is the block's own (moe_topk), not a config's num_experts_per_tok
        assert row["k"] == 3


def test_margin_is_the_kth_minus_the_next_logit():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.5], [0.0, 0.0, 5.0, 1.0]])
    ids = torch.tensor([[0, 2], [2, 3]])
    assert torch.allclose(layer_margin(logits, ids), torch.tensor([1.0, 1.0]))
    # a decision that is not the top-k of the logits (a biased router): negative
    assert layer_margin(logits, torch.tensor([[1, 3], [0, 1]]))[0] == 0.5 - 3.0
    assert torch.isnan(layer_margin(logits[:, :2], torch.tensor([[0, 1], [0, 1]]))).all()


def test_moe_blocks_of_a_second_layer_list_are_named_not_merged():
    """Two towers with MoE layers (a thinker and a talker): the first tower's routes are captured, the
    second's MoE modules are listed as uncaptured instead of landing on the same layer indices."""
    thinker, _ = mf.build("qwen3_moe")
    talker, _ = mf.build("qwen3_moe", seed=1)
    both = torch.nn.Module()
    both.thinker, both.talker = thinker, talker
    layout = find_sources(both)
    assert all(s.name.startswith("thinker.") for s in layout.sources.values()) and sorted(layout.sources) == [0, 1, 2]
    assert set(layout.uncaptured) == {f"talker.model.layers.{i}.mlp.{m}" for i in range(3) for m in ("experts", "gate")}


def main() -> None:
    print("| family | model | module class captured | captured | share equal | dense layers | notes |")
    print("|---|---|---|---|---|---|---|")
    for family in FAMILIES:
        r = run_family(family)
        if not r["built"] or not r.get("forward"):
            print(f"| {family} | {r.get('model', '-')} | - | no (not built) | - | - | {r['notes']} |")
            continue
        cap = "yes" if r["captured_layers"] and not r["uncaptured"] else "no"
        notes = "; ".join(x for x in (r["notes"], f"margin median {r['margin_median']:.3g}"
                                      if r["margin_median"] is not None else "no router logits declared") if x)
        print(f"| {family} | {r['model']} | {', '.join(r['classes'])} ({', '.join(r['kinds'])}) | {cap} | "
              f"{r['share_equal']:.3f} | {r['dense']} of {r['layers']} | {notes} |")


if __name__ == "__main__":
    main()
