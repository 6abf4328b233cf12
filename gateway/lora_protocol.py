"""The bodies of vLLM's LoRA routes, ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Validated strictly like the OpenAI bodies (``tandem.gateway.protocol``: a missing field or a
wrong type is a 400 naming it, other fields are ignored, as vLLM's ``lora_int_id``). What a name
or a path must be is checked where the adapter is loaded (``tandem.gateway.lora_adapters``).
"""

from __future__ import annotations

from tandem.gateway.protocol import StrictModel


class LoadLoraAdapterRequest(StrictModel):
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(StrictModel):
    lora_name: str


def loaded_text(name: str) -> str:
    """vLLM's plain-text reply to a load."""
    return f"Success: LoRA adapter '{name}' added successfully."


def unloaded_text(name: str) -> str:
    """vLLM's plain-text reply to an unload."""
    return f"Success: LoRA adapter '{name}' removed successfully."
