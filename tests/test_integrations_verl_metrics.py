"""The verl hook's `kldiag/...` tracker metrics through verl 0.9.1's own code.

What runs for real: verl's `ppo_loss` under the recording loss, verl's metric plumbing
(`append_to_dict`, `Metric.aggregate_dp`, `reduce_metrics`, `rename_dict`) and the V1 trainer's
`_update_actor` under kldiag's subclass, whose `metrics` dict is what verl's `fit` hands its
tracker (`self.logger.log(data=metrics, ...)`, trainer_base.py l. 514). The worker group is a
stand-in that replays train_mini_batch's metric handling for one DP rank (engine_workers.py
l. 243-330, _postprocess_output l. 185-215) around the installed loss, as the other verl tests do.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import pytest

torch = pytest.importorskip("torch")
verl = pytest.importorskip("verl")
v1 = pytest.importorskip("verl.trainer.ppo.v1")

from tensordict.tensorclass import NonTensorData  # noqa: E402
from test_integrations_verl import actor, forward, make_batch, model  # noqa: E402, F401 - the fixture too
from test_integrations_verl_trainer import config, trainer_of  # noqa: E402, F401 - the fixture too
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.metric import Metric, reduce_metrics  # noqa: E402
from verl.utils.py_functional import append_to_dict  # noqa: E402

import kldiag  # noqa: E402
from kldiag.integrations import verl as hook  # noqa: E402
from kldiag.integrations.common.step_metrics import StepWindow  # noqa: E402
from kldiag.integrations.trl.metrics import batch_partials, log_metrics, merge_partials  # noqa: E402
from kldiag.integrations.verl import metrics as verl_metrics  # noqa: E402

NAMES = ("k3_mean", "k3_is_mean", "weight_k3_abs_max", "weight_k3_is_abs_max", "flagged_frac", "blame_share",
         "rho_max", "nonfinite_count")


@pytest.fixture(autouse=True)
def _fresh_state():
    hook.STATE.__init__()
    yield
    hook.close()


def gather_minis(per_rank: list[list[list[dict]]]) -> dict:
    """train_mini_batch's metrics: per mini-batch, each rank's micro metrics (append_to_dict), all-gathered
    over DP (allgather_dict_into_dict), flattened (Metric.aggregate_dp / chain), appended across minis."""
    out: dict = {}
    for minis in zip(*per_rank, strict=True):
        ranks = []
        for micros in minis:
            agg: dict = {}
            for m in micros:
                append_to_dict(agg, m)
            ranks.append(agg)
        gathered = {k: [r[k] for r in ranks if k in r] for k in dict.fromkeys(k for r in ranks for k in r)}
        gathered["mfu"] = [[0.5]]  # _postprocess_output adds it
        flat = {k: Metric.aggregate_dp(v) if isinstance(v[0], Metric) else list(chain.from_iterable(v))
                for k, v in gathered.items()}
        append_to_dict(out, flat)
    return out


class ReplayingWorkers:
    """The actor worker group: runs the installed loss over a fresh batch per update, as one DP rank."""

    def __init__(self, model, loss_fn):
        self.model, self.loss_fn = model, loss_fn

    def update_actor(self, batch):
        step = batch.extra_info["kldiag_step"]
        data = make_batch(4, 2, seed=step, ref_shift=1.0)
        minis = []
        for mb in tu.make_iterator(data, mini_batch_size=4, epochs=1, seed=42, dataloader_kwargs={"shuffle": True}):
            tu.assign_non_tensor(mb, global_token_num=NonTensorData(mb["input_ids"].offsets().diff().tolist()),
                                 update_lr_scheduler=True, dp_size=1, kldiag_step=step,
                                 batch_num_tokens=int(mb["response_mask"].values().sum()), global_batch_size=4)
            micros = []
            for mu in tu.chunk_tensordict(mb, 2):
                with torch.enable_grad():
                    micros.append(self.loss_fn(model_output=forward(self.model, mu), data=mu, dp_group=None)[1])
            minis.append(micros)
        return {"metrics": gather_minis([minis])}


def train(config, tmp_path, model, steps, between=None):
    """verl's _update_actor for global steps 1..steps; the metrics dict verl logs at each."""
    from transfer_queue import KVBatchMeta

    trainer = trainer_of(config, tmp_path)
    trainer.actor_rollout_wg = ReplayingWorkers(model, hook.loss_fn(actor(), tmp_path / "run"))
    logged = {}
    for step in range(1, steps + 1):
        trainer.global_steps, metrics = step, {}
        trainer._update_actor(KVBatchMeta(keys=["a"], tags=[{}], partition_id="train"), metrics)
        logged[step] = metrics
        (between or (lambda: hook.STATE.recorder.wait_converted(10.0)))()  # the next rollout runs meanwhile
    hook.close()
    return logged


def test_verls_logged_metrics_carry_the_previous_steps_kldiag_figures(config, tmp_path, model):
    logged = train(config, tmp_path, model, 3)
    steps = kldiag.analyze(tmp_path / "run").steps.to_pandas().set_index("step")
    assert not any(k.startswith("kldiag/") for k in logged[1])  # nothing recorded before step 1
    for at, step in ((2, 1), (3, 2)):
        m = logged[at]
        assert m["kldiag/step"] == step and "actor/kl_loss" in m
        assert not any("kldiag_partials" in k for k in m)
        for name in NAMES:
            assert m["kldiag/" + name] == pytest.approx(steps.loc[step, name], rel=1e-6, abs=1e-12), (name, step)
    assert logged[2]["kldiag/k3_mean"] != logged[3]["kldiag/k3_mean"]


def test_a_late_writer_leaves_steps_out_and_never_mixes_them(config, tmp_path, model, monkeypatch):
    calls = []

    def late_at_step_2():
        calls.append(1)
        rec = hook.STATE.recorder
        if len(calls) == 1:  # step 2's report finds the writer behind (no wait), then it catches up
            monkeypatch.setattr(rec, "wait_converted", lambda timeout=1.0, _w=rec.wait_converted: False)
        else:
            monkeypatch.undo()
            rec.wait_converted(10.0)

    logged = train(config, tmp_path, model, 4, between=late_at_step_2)
    steps = kldiag.analyze(tmp_path / "run").steps.to_pandas().set_index("step")
    assert not any(k.startswith("kldiag/") for k in logged[2])  # late
    assert not any(k.startswith("kldiag/") for k in logged[3])  # its window would hold steps 1 and 2
    assert logged[4]["kldiag/step"] == 3
    assert logged[4]["kldiag/k3_mean"] == pytest.approx(steps.loc[3, "k3_mean"], rel=1e-6)


class Rank:
    """A recorder stand-in for one DP rank: feeds StepWindow the batches as the writer would."""

    def __init__(self):
        self.observers = []

    def observe(self, fn):
        self.observers.append(fn)

    def wait_converted(self, timeout=1.0):
        return True


def test_two_dp_ranks_reduce_to_the_figures_of_all_their_tokens():
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(5):
        s = rng.normal(-2, 1, (3, 6)).astype(np.float32)
        batches.append({"logp": s, "logp_ref": s + rng.normal(0, 1, s.shape).astype(np.float32),
                        "logp_old": s + rng.normal(0, 0.3, s.shape).astype(np.float32),
                        "mask": rng.random(s.shape) > 0.2})
    ranks = [Rank(), Rank()]
    windows = [StepWindow(r) for r in ranks]
    for i, b in enumerate(batches):  # rank 0 gets 3 batches, rank 1 gets 2
        ranks[i % 2].observers[0](b)
    reports = [[[verl_metrics.report(w, 4, world=2)]] for w in windows]  # 1 mini-batch, 1 reporting micro-batch
    metrics = reduce_metrics({f"actor/{k}": v for k, v in gather_minis(reports).items()})
    added = verl_metrics.finish(metrics)
    whole = batch_partials(batches[0]["logp"], batches[0]["logp_ref"], batches[0]["logp_old"], batches[0]["mask"])
    for b in batches[1:]:
        whole = merge_partials(whole, batch_partials(b["logp"], b["logp_ref"], b["logp_old"], b["mask"]))
    want = log_metrics(whole, True)
    assert added.pop("kldiag/step") == 4
    assert added.keys() == want.keys()
    for k, v in want.items():
        assert added[k] == pytest.approx(v, rel=1e-9), k
    assert not any("kldiag_partials" in k for k in metrics)
