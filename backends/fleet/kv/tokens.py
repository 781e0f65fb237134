"""A request's prompt as the token ids vLLM will compute, with the model's own tokenizer.

vLLM renders a chat request with the tokenizer's chat template (Hugging Face
``apply_chat_template``: ``add_generation_prompt`` unless the request says otherwise, its
``tools`` and ``chat_template_kwargs``), then tokenizes the text with
``add_special_tokens`` false (the template writes them); a completions prompt string is
tokenized with special tokens, and token-id prompts are taken as they are. transformers'
``AutoTokenizer`` does both exactly as vLLM does, from the same files (vLLM loads the
tokenizer through it). A prompt the gateway cannot render the same way (images, a template
that fails) gives None, and placement falls back to the prefix hash.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("semcache.backends")


class PromptTokenizer:
    """Token ids of chat, completions and Responses API prompts for one model."""

    def __init__(self, model_dir: Path, chat_template: str | None = None) -> None:
        """``chat_template``: the backend's own (``--chat-template``), else the folder's."""
        from transformers import AutoTokenizer  # a few seconds: only where kv placement runs

        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self._template = chat_template

    def prompt_tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        try:
            if path.endswith("/chat/completions"):
                return self._chat(body)
            if path.endswith("/completions"):
                return self._completion(body)
        except Exception as exc:  # a template or body it cannot render: no exact blocks
            log.debug("kv placement: prompt not tokenized (%s)", exc)
        return None

    def _chat(self, body: dict[str, Any]) -> list[int] | None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("content", ""), str | None) for m in messages
        ):
            return None  # multimodal parts: vLLM's rendering adds placeholders of its own
        kwargs = dict(body.get("chat_template_kwargs") or {})
        continue_final = bool(body.get("continue_final_message", False))
        text = self._tokenizer.apply_chat_template(
            messages,
            tools=body.get("tools"),
            tokenize=False,
            add_generation_prompt=bool(body.get("add_generation_prompt", not continue_final)),
            continue_final_message=continue_final,
            chat_template=self._template,
            **kwargs,
        )
        add_special = bool(body.get("add_special_tokens", False))
        return list(self._tokenizer(text, add_special_tokens=add_special)["input_ids"])

    def _completion(self, body: dict[str, Any]) -> list[int] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if not isinstance(prompt, str):
            return None
        add_special = bool(body.get("add_special_tokens", True))
        return list(self._tokenizer(prompt, add_special_tokens=add_special)["input_ids"])
