"""Multi-turn (agentic) rollouts in each framework: how it keeps the engine's token ids (token-in-token-out).

The fix for `engine_retokenization` (kldiag/diagnosis/retokenize.py), phrased with each framework's own
mechanism, checked against the frameworks' sources named in each text (TRL's and the plain-torch one are in
their modules' FIXES). No I/O.
"""

from __future__ import annotations

from typing import Any

from kldiag.frameworks import fix_for, plain, trainer_name

CAUSE = "engine_retokenization"
TITO = plain.FIXES[CAUSE].rstrip(".")  # the generic fix; TRL's is in kldiag/frameworks/trl.py (FIXES)

RETOKENIZE_FIXES: dict[str, str] = {
    "verl": (TITO + ". verl's agent loops build the token stream with the Continuous Token builder "
             "(verl/experimental/agent_loop/agent_loop.py, verl 0.9.1: `ct_merge_assistant_token` appends the "
             "engine's response ids, `ct_merge_context_msg` a tool reply); a custom AgentLoopBase subclass must "
             "go through them rather than `tokenizer.apply_chat_template` over the whole history. A model_type "
             "the builder registry does not know (verl/utils/tokenizer/continuous_token_wiring.py, "
             "create_continuous_token_builder) falls back to the default builder with a warning: its boundary "
             "tokens may differ from the model's template"),
    "slime": (TITO + ". In slime, a `--custom-generate-function-path` function fills `Sample.tokens` with "
              "SGLang's output token ids (`return_logprob=True`) and masks tool and template text with "
              "`loss_mask` (docs/en/get_started/agent.md, slime 624b824); the agent adapters and "
              "TrajectoryManager (slime/agent/trajectory.py) handle drift by REALIGN (the drifted span gets "
              "loss_mask 0) or FORK (a new sample) instead of training on re-tokenised text"),
    "skyrl": (TITO + ". In SkyRL, `custom_chat_template` with `use_conversation_multi_turn` re-tokenises the "
              "whole chat history every turn (skyrl/train/generators/skyrl_gym_generator.py, "
              "`_update_agent_state_by_retokenizing_chat_history`, which also drops the rollout log-probs); "
              "leave `custom_chat_template` unset so the generator appends output and observation ids "
              "(`_update_agent_loop_state_with_multiturn_chat_template`)"),
}


def retokenize_fix(manifest: Any) -> str:
    """The re-tokenisation fix for the run's trainer: verl, slime (and Miles), SkyRL here by trainer name, TRL and
    the rest from their FIXES (kldiag.frameworks.fix_for: plain-torch advice for a framework without one)."""
    name = trainer_name(manifest)
    for prefix, key in (("verl", "verl"), ("slime", "slime"), ("miles", "slime"), ("skyrl", "skyrl")):
        if name.startswith(prefix):
            return RETOKENIZE_FIXES[key]
    return fix_for(CAUSE, manifest)
