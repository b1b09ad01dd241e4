"""Run NeMo-RL@7ea279ab's own ClippedPGLossFn on tests/test_crosswalk_nemo_rl.py's fixture; write the golden JSON.
The train loop's metric reduction (automodel/train.py l. 523-534: metrics[k] /= num_global_batches per micro-batch;
grpo.py l. 3466-3489: np.sum over the step's micro-batch values) is mirrored here.
Usage (outside the test suite; needs the framework's source, which this project does not contain):
    git clone https://github.com/NVIDIA-NeMo/RL src && git -C src checkout 7ea279ab
    FRAMEWORK_SRC=src python tests/golden/generate/gen_nemo.py OUT.json
"""
import os
import importlib.util, json, sys, types
import numpy as np
import torch

SRC = os.environ["FRAMEWORK_SRC"]  # a checkout of the pinned commit (see the header)
COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"

def stub(name, **attrs):
    m = types.ModuleType(name); m.__dict__.update(attrs); sys.modules[name] = m; return m

class Any_(types.ModuleType):
    def __getattr__(self, k):
        if k.startswith("__"): raise AttributeError(k)
        return None
for name in ("nemo_rl.algorithms.x_token", "nemo_rl.algorithms.x_token.loss_utils", "nemo_rl.distributed",
             "nemo_rl.distributed.model_utils", "nemo_rl.models", "nemo_rl.models.dtensor", "nemo_rl.models.dtensor.parallelize",
             "nemo_rl.data", "nemo_rl.data.chat_templates", "nemo_rl.models.policy", "nemo_rl.utils", "nemo_rl.utils.fastokens",
             "nemo_rl.utils.logger"):
    sys.modules[name] = Any_(name)
stub("nemo_rl.distributed.batched_data_dict", BatchedDataDict=dict)
for pkg in ("nemo_rl", "nemo_rl.algorithms", "nemo_rl.algorithms.loss"):
    m = stub(pkg); m.__path__ = [SRC + "/" + pkg.replace(".", "/")]

def load(name):
    spec = importlib.util.spec_from_file_location(name, SRC + "/" + name.replace(".", "/") + ".py")
    m = importlib.util.module_from_spec(spec); sys.modules[name] = m; spec.loader.exec_module(m); return m

load("nemo_rl.algorithms.loss.interfaces"); load("nemo_rl.algorithms.utils")
LF = load("nemo_rl.algorithms.loss.loss_functions")

spec = importlib.util.spec_from_file_location("fx", os.path.join(os.path.dirname(__file__), "..", "..", "test_crosswalk_nemo_rl.py"))
fxmod = importlib.util.module_from_spec(spec); spec.loader.exec_module(fxmod)
KEEP = ("token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error")

def run(c, fx, mbs=2):
    cfg = LF.ClippedPGLossConfig(reference_policy_kl_penalty=0.0, reference_policy_kl_type=c.get("reference_policy_kl_type", "k3"),
                                 force_on_policy_ratio=c.get("force_on_policy_ratio", False))
    fn = LF.ClippedPGLossFn(cfg)
    B = len(fx["sample_mask"])
    size = c["num_prompts_per_step"] * c["num_generations_per_prompt"] if c.get("num_prompts_per_step") else B
    gbs = c.get("train_global_batch_size") or size
    n_gb = size // gbs
    pad = lambda x: torch.from_numpy(np.concatenate([np.zeros((B, 1), x.dtype), x], 1))  # NeMo's position 0 is dropped ([:, 1:])
    data = {"prev_logprobs": pad(fx["prev"]), "generation_logprobs": pad(fx["gen"]), "token_mask": pad(fx["token_mask"].astype(fx["prev"].dtype)),
            "sample_mask": torch.from_numpy(fx["sample_mask"]), "advantages": pad(np.ones_like(fx["prev"])),
            "input_ids": torch.zeros(B, fx["prev"].shape[1] + 1, dtype=torch.long)}
    curr = torch.from_numpy(fx["prev"])  # the first update's forward: pi_theta = pi_old
    all_mb = {}
    for g in range(n_gb):
        sl = slice(g * gbs, (g + 1) * gbs)
        gvt = (data["token_mask"][sl, 1:] * data["sample_mask"][sl, None]).sum()
        gvs = data["sample_mask"][sl].sum()
        for s in range(sl.start, sl.stop, mbs):
            e = min(s + mbs, sl.stop); mb = {k: v[s:e] for k, v in data.items()}
            _, metrics = fn(curr[s:e], mb, gvs, gvt)
            for k in metrics:
                if "_min" in k or "_max" in k:
                    continue
                metrics[k] /= n_gb
            for k, v in metrics.items():
                all_mb.setdefault(k, []).append(v)
    return {k: float(np.sum(all_mb[k])) for k in KEEP}

CONFIGS = [{}, {"train_global_batch_size": 4}, {"train_global_batch_size": 2}, {"reference_policy_kl_type": "k1", "train_global_batch_size": 4},
           {"reference_policy_kl_type": "k2"}, {"reference_policy_kl_type": "k2", "train_global_batch_size": 2},
           {"force_on_policy_ratio": True, "train_global_batch_size": 8},
           {"train_global_batch_size": 3, "num_prompts_per_step": 4, "num_generations_per_prompt": 2}]
cases = []
for dtype in ("float32", "float64"):
    fx = fxmod.fixture(0, np.dtype(dtype).type)
    for c in CONFIGS:
        cases.append({"dtype": dtype, "settings": c, "metrics": run(c, fx)})
out = {"source": {"repository": "NVIDIA-NeMo/RL", "commit": COMMIT,
                  "files": ["nemo_rl/algorithms/loss/loss_functions.py", "nemo_rl/algorithms/utils.py",
                            "nemo_rl/models/automodel/train.py", "nemo_rl/algorithms/grpo.py"],
                  "functions": ["ClippedPGLossFn.__call__", "calculate_kl", "masked_mean",
                                "automodel_forward_backward (metrics[k] /= num_global_batches)", "grpo_train (np.sum of all_mb_metrics)"],
                  "generator": "run outside this repository (NeMo-RL code is not vendored): ClippedPGLossFn once per micro-batch (2 samples) "
                               "of each global batch of tests/test_crosswalk_nemo_rl.py fixture(seed), with the global batch's valid "
                               "token and sample counts; the train loop's two reduction lines mirrored; stubbed: imports the loss "
                               "path never calls (x_token, model_utils, dtensor, chat templates, logger)",
                  "torch": torch.__version__},
       "seed": 0, "cases": cases}
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(len(cases), "cases")
