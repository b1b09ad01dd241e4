"""Run slime@624b824a's own metric code on tests/test_crosswalk_slime.py's fixture; write the golden JSON.
Stubs: megatron.core.mpu (cp=dp=1), torch.distributed.all_reduce (one rank), torch.compile (eager), and
slime modules loss.py imports but the metric path never calls. Model forward: the fixture's log-probs.
Usage (outside the test suite; needs the framework's source, which this project does not contain):
    git clone https://github.com/THUDM/slime src && git -C src checkout 624b824a
    FRAMEWORK_SRC=src python tests/golden/generate/gen_slime.py OUT.json
"""
import os
import importlib.util, json, sys, types
from argparse import Namespace
import numpy as np
import torch

SRC = os.environ["FRAMEWORK_SRC"]  # a checkout of the pinned commit (see the header)
COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
torch.compile = lambda f=None, **kw: f if f is not None else (lambda g: g)
torch.distributed.all_reduce = lambda t, group=None: None

def stub(name, **attrs):
    m = types.ModuleType(name); m.__dict__.update(attrs); sys.modules[name] = m; return m

mpu = Namespace(get_context_parallel_world_size=lambda: 1, get_context_parallel_group=lambda: None, get_data_parallel_world_size=lambda **k: 1)
stub("megatron"); stub("megatron.core", mpu=mpu)
for pkg in ("slime", "slime.backends", "slime.backends.megatron_utils", "slime.utils", "slime.observability"):
    m = stub(pkg); m.__path__ = [SRC + "/" + pkg.replace(".", "/")]
stub("slime.utils.distributed_utils", distributed_masked_whiten=None)
LOADED = {}
stub("slime.utils.misc", load_function=lambda path: getattr(sys.modules[path.rsplit(".", 1)[0]], path.rsplit(".", 1)[1]))
stub("slime.utils.types", RolloutBatch=dict)
stub("slime.observability.logging_utils"); stub("slime.observability.metric_utils", compute_pass_rate=None, compute_rollout_step=None)
stub("slime.observability.timer", Timer=None); stub("slime.utils.flops_utils", calculate_fwd_flops=None)

def load(name):
    spec = importlib.util.spec_from_file_location(name, SRC + "/" + name.replace(".", "/") + ".py")
    m = importlib.util.module_from_spec(spec); sys.modules[name] = m; spec.loader.exec_module(m); return m

load("slime.utils.ppo_utils"); load("slime.backends.megatron_utils.cp_utils")
loss = load("slime.backends.megatron_utils.loss")
tmu = load("slime.observability.train_metric_utils")

spec = importlib.util.spec_from_file_location("fx", os.path.join(os.path.dirname(__file__), "..", "..", "test_crosswalk_slime.py"))
fxmod = importlib.util.module_from_spec(spec); spec.loader.exec_module(fxmod)

CURRENT = {}
loss.get_log_probs_and_entropy = lambda logits, **kw: (None, {"log_probs": CURRENT["lp"], "entropy": [x * 0 for x in CURRENT["lp"]]})

CONFIGS = [{}, {"calculate_per_token_loss": True}, {"advantage_estimator": "gspo"},
           {"advantage_estimator": "gspo", "calculate_per_token_loss": True},
           {"tis_function": "icepop", "tis_clip_low": 0.5}, {"tis_function": "icepop", "tis_clip_low": 0.5, "calculate_per_token_loss": True},
           {"tis_clip": 1.5, "tis_clip_low": 0.8}, {"tis_clip": 1.5, "tis_clip_low": 1.0},
           {"tis_function": "icepop", "tis_clip": 1.0, "tis_clip_low": 0.5},
           {"kl_loss_type": "low_var_kl", "use_unbiased_kl": True},
           {"kl_loss_type": "low_var_kl", "use_unbiased_kl": True, "calculate_per_token_loss": True},
           {"kl_loss_type": "k2"}, {"kl_loss_type": "k3", "use_unbiased_kl": True, "advantage_estimator": "gspo"},
           {"use_rollout_logprobs": True}, {"use_rollout_logprobs": True, "advantage_estimator": "gspo", "calculate_per_token_loss": True},
           {"use_rollout_logprobs": True, "kl_loss_type": "low_var_kl", "use_unbiased_kl": True}]

def args_of(c):
    rl = c.get("use_rollout_logprobs", False)
    fn = {"vanilla": "vanilla_tis_function", "icepop": "icepop_function"}[c.get("tis_function", "vanilla")]
    return Namespace(use_rollout_logprobs=rl, advantage_estimator=c.get("advantage_estimator", "grpo"), rollout_top_p=1.0,
                     use_opsm=False, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None, get_mismatch_metrics=rl,
                     use_tis=not rl, custom_tis_function_path=None if fn == "vanilla_tis_function" and not rl else
                     "slime.backends.megatron_utils.loss." + fn,
                     tis_clip=c.get("tis_clip", 2.0), tis_clip_low=c.get("tis_clip_low", 0.0),
                     calculate_per_token_loss=c.get("calculate_per_token_loss", False), custom_pg_loss_reducer_function_path=None,
                     entropy_coef=0.0, use_kl_loss=True, kl_loss_coef=0.01, kl_loss_type=c.get("kl_loss_type", "k1"),
                     use_unbiased_kl=c.get("use_unbiased_kl", False), loss_type="policy_loss", recompute_loss_function=False,
                     allgather_cp=False)

def run(c, fx):
    args = args_of(c)
    t = lambda k, i: torch.from_numpy(np.asarray(fx[k][i]))
    micro = fx["micro"]; logs = []
    for mb in np.unique(micro):
        idx = np.flatnonzero(micro == mb)
        masks = [torch.from_numpy(fx["mask"][i].astype(np.int32)) for i in idx]
        batch = {"advantages": [torch.ones(len(fx["mask"][i]), dtype=t("logp", i).dtype) for i in idx],
                 "log_probs": [t("logp_old", i) for i in idx], "rollout_log_probs": [t("logp_sampler", i) for i in idx],
                 "ref_log_probs": [t("logp_ref", i) for i in idx], "response_lengths": [len(fx["mask"][i]) for i in idx],
                 "total_lengths": [len(fx["mask"][i]) + 4 for i in idx], "loss_masks": masks,
                 "rollout_mask_sums": torch.stack([m.sum().float() for m in masks]), "unconcat_tokens": [None for _ in idx]}
        CURRENT["lp"] = [t("logp", i) for i in idx]
        _, _, log = loss.loss_function(args, batch, len(np.unique(micro)), len(micro), torch.zeros(1, 4, 8))
        logs.append(log)
    red = tmu.reduce_train_step_metrics(logs, calculate_per_token_loss=args.calculate_per_token_loss,
                                        step_global_batch_size=len(micro), cp_size=1, dp_with_cp_group=None)
    keep = ("train_rollout_logprob_abs_diff", "ois", "tis", "tis_abs", "tis_clipfrac", "kl_loss")
    return {k: float(v) for k, v in red.items() if k in keep}

cases = []
for dtype in ("float32", "float64"):
    fx = fxmod.fixture(0, np.dtype(dtype).type)
    for c in CONFIGS:
        cases.append({"dtype": dtype, "settings": c, "metrics": run(c, fx)})
out = {"source": {"repository": "THUDM/slime", "commit": COMMIT,
                  "files": ["slime/backends/megatron_utils/loss.py", "slime/backends/megatron_utils/cp_utils.py",
                            "slime/utils/ppo_utils.py", "slime/observability/train_metric_utils.py"],
                  "functions": ["loss_function", "policy_loss_function", "vanilla_tis_function", "icepop_function",
                                "get_sum_of_sample_mean", "compute_gspo_kl", "compute_approx_kl", "reduce_train_step_metrics"],
                  "generator": "run outside this repository (slime code is not vendored): one loss_function call per micro-batch "
                               "of tests/test_crosswalk_slime.py fixture(seed), then reduce_train_step_metrics; stubbed: megatron mpu "
                               "(cp=dp=1), torch.distributed.all_reduce (one rank), torch.compile (eager), the model forward (the "
                               "fixture's log-probs)",
                  "torch": torch.__version__},
       "seed": 0, "cases": cases}
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(len(cases), "cases", sum(len(c["metrics"]) for c in cases), "figures")
