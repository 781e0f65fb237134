"""A model folder's ``tokenizer.json`` through the `tokenizers` library alone, called as the
encoders call a Hugging Face tokenizer: so an encoder whose ONNX graph is already checked
loads without importing torch, transformers or sentence-transformers (seconds at start-up).

Hugging Face's fast tokenizers run this same ``tokenizers.Tokenizer``, setting truncation and
padding per call; the calls here do the same. Checked against transformers 5.19 and
tokenizers 0.23 (``tests/backends/test_onnx_tokenizer.py`` compares ids, arrays and decoded
text with the ``SentenceTransformer``'s own tokenizer).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

TOKENIZER_FILE = "tokenizer.json"
_CLEANUPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class JsonTokenizer:
    """``tokenizer(texts, add_special_tokens=, padding=, truncation=, max_length=,
    return_tensors="np")`` and ``decode(ids, skip_special_tokens=)`` on a ``tokenizer.json``.

    Each combination of truncation and padding gets its own ``tokenizers.Tokenizer``,
    configured once: one that several threads share is never reconfigured under them.
    """

    def __init__(self, model_dir: Path, model_max_length: int | None = None) -> None:
        """``model_max_length``: where ``truncation=True`` without ``max_length`` cuts (a
        ``SentenceTransformer`` sets its max_seq_length there); default the folder's own."""
        self._json = (model_dir / TOKENIZER_FILE).read_text(encoding="utf-8")
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.model_max_length = model_max_length or int(config.get("model_max_length", 512))
        self._cleanup = bool(config.get("clean_up_tokenization_spaces", False))
        self._pad_token = str(config.get("pad_token", "[PAD]"))
        self._configured: dict[tuple[bool, int | None], Any] = {}
        self._lock = threading.Lock()

    def _tokenizer(self, padding: bool, max_length: int | None) -> Any:
        key = (padding, max_length)
        with self._lock:
            found = self._configured.get(key)
            if found is None:
                from tokenizers import Tokenizer

                found = Tokenizer.from_str(self._json)
                found.no_truncation()
                found.no_padding()
                if max_length is not None:
                    found.enable_truncation(max_length)
                if padding:
                    pad_id = found.token_to_id(self._pad_token)
                    found.enable_padding(pad_id=pad_id or 0, pad_token=self._pad_token)
                self._configured[key] = found
            return found

    def __call__(
        self,
        texts: Sequence[str],
        *,
        add_special_tokens: bool = True,
        padding: bool = False,
        truncation: bool = False,
        max_length: int | None = None,
        return_tensors: str | None = None,
    ) -> dict[str, Any]:
        limit = (max_length or self.model_max_length) if truncation else None
        tokenizer = self._tokenizer(padding, limit)
        encoded = tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        out: dict[str, Any] = {
            "input_ids": [e.ids for e in encoded],
            "token_type_ids": [e.type_ids for e in encoded],
            "attention_mask": [e.attention_mask for e in encoded],
        }
        if return_tensors == "np":
            return {name: np.asarray(rows, dtype=np.int64) for name, rows in out.items()}
        if return_tensors is not None:
            raise ValueError(f"return_tensors={return_tensors!r}: only 'np' is offered")
        return out

    def __len__(self) -> int:
        """The vocabulary's size, added tokens included (as a Hugging Face tokenizer's)."""
        size: int = self._tokenizer(False, None).get_vocab_size(with_added_tokens=True)
        return size

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text: str = self._tokenizer(False, None).decode(
            list(token_ids), skip_special_tokens=skip_special_tokens
        )
        if self._cleanup:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text
