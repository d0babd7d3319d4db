"""The Gemma 4 assistant drafter (transformers' `Gemma4AssistantForCausalLM`, model_type
`gemma4_assistant`): its configuration, weights, draft forward over the base's KV planes, and
the speculative head. docs/assistant.md says how it drafts and which rounds it runs in."""

from npud.engine.assistant.config import AssistantConfig, load_assistant_config, parse_assistant_config
from npud.engine.assistant.forward import Assistant, AssistantMismatchError, BaseKV, draft_step
from npud.engine.assistant.head import AssistantHead

__all__ = [
    "Assistant", "AssistantConfig", "AssistantHead", "AssistantMismatchError", "BaseKV", "draft_step",
    "load_assistant_config", "parse_assistant_config",
]
