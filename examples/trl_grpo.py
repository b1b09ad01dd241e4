"""kldiag on a real TRL GRPOTrainer run, on CPU, in about a minute, with nothing downloaded.

    python examples/trl_grpo.py --run-dir kldiag_runs/trl_grpo_tiny
    python examples/trl_grpo.py --run-dir kldiag_runs/trl_grpo_k3 --no-bias-correction

The model is a 2-layer Qwen2 built from a config, with a word-level tokenizer trained on
a few sentences (both saved to a temp dir: TRL loads the policy and the reference model by
path). The reward wants "cat" and punishes "the", a word the reference model likes: as
the policy learns to avoid it, the rare times it still samples "the" are tokens where
pi_theta << pi_ref, whose K3 gradient weight 1 - pi_ref/pi_theta blows up. kldiag records
every loss micro-batch and adds kldiag/... metrics to the trainer's logs.

The one line that matters is `attach(trainer, run_dir)`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

WORDS = [
    "the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "log", "red", "blue", "big", "small", "and",
    "then", "it", "was", "happy", "sad", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
]


def build_tiny_model(path: Path, seed: int = 0) -> Path:
    """Save a 2-layer Qwen2 (hidden 32) and a WordLevel tokenizer of WORDS to `path`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    # "the" every third word: the reference model learns nothing, but the text covers the vocabulary.
    text = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(12)) for i in range(100)]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(text, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<eos>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<eos>")
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def cat_not_the(completions: list[str], **kwargs) -> list[float]:
    """+1 per "cat", -1 per "the": the policy must move away from the reference on "the"."""
    return [float(c.split().count("cat") - c.split().count("the")) for c in completions]


def make_trainer(model_dir: Path, output_dir: Path, steps: int = 40, bias_correction: bool = True,
                 seed: int = 0, **overrides):
    """A GRPOTrainer on the tiny model: beta > 0 and num_iterations = 2, so logp, logp_old, logp_ref differ."""
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    options = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "num_generations": 8,
               "max_completion_length": 12, "num_iterations": 2, "beta": 0.04, "learning_rate": 3e-2,
               "max_steps": steps, "logging_steps": 1, "report_to": [], "use_cpu": True, "seed": seed,
               "save_strategy": "no", "disable_tqdm": True, "use_bias_correction_kl": bias_correction}
    options.update(overrides)
    prompts = [" ".join(WORDS[i % 20:i % 20 + 3]) for i in range(256)]
    return GRPOTrainer(model=str(model_dir), reward_funcs=cat_not_the,
                       args=GRPOConfig(output_dir=str(output_dir), **options),
                       train_dataset=Dataset.from_dict({"prompt": prompts}),
                       # Not AutoTokenizer: it would pick Qwen2Tokenizer from config.json and rebuild a BPE.
        processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default="kldiag_runs/trl_grpo_tiny", help="kldiag run directory to write")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--no-bias-correction", action="store_true",
                        help="use_bias_correction_kl=False: TRL's plain K3 penalty instead of k3_is")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import kldiag
    from kldiag.integrations.trl import attach

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=args.seed)
        trainer = make_trainer(model_dir, Path(tmp) / "out", steps=args.steps,
                               bias_correction=not args.no_bias_correction, seed=args.seed)
        rec = attach(trainer, args.run_dir, tags={"example": "trl_grpo"})
        trainer.train()  # the recorder is closed when training ends

    print(f"\nrecorded {rec.stats['rows']} tokens in {rec.stats['files']} files to {args.run_dir}")
    for h in trainer.state.log_history[-3:-1]:
        shown = {k: round(v, 4) for k, v in h.items() if k in ("step", "kl") or k.startswith("kldiag/")}
        print(shown)
    analysis = kldiag.analyze(args.run_dir)
    worst = analysis.steps.sort_by([("weight_k3_abs_max", "descending")]).slice(0, 1).to_pylist()[0]
    print(f"largest |k3 weight| {worst['weight_k3_abs_max']:.3g} at step {worst['step']}; "
          f"{analysis.alerts.num_rows} alerts")
    print(f"look at it: kldiag dashboard {args.run_dir}    or: kldiag report {args.run_dir} -o report.html")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
