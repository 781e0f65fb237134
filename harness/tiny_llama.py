"""A tiny random-weight Llama (HF folder) that real vLLM serves in seconds, for tests.

2 layers, hidden 128, 2 heads of 64 (a head size vLLM's CPU attention supports), a byte-level
BPE tokenizer trained here on generated English, and a Llama-3 style chat template that
renders tools too, so /v1/completions and /v1/chat/completions (tool calls included) work.
Seeds are fixed: the folder is the same on every build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

READY_MARKER = ".semcache-ready"
TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
}
"""The tiny models' shape (the chat Llama and the classifier built on its tokenizer)."""

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", EOT]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] | trim }}\n\n{% endif %}"
    "You may call these tools: <tools>{{ tools | tojson }}</tools>\n"
    'To call one, answer <tool_call>{"name": NAME, "arguments": ARGUMENTS}</tool_call>'
    "<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "<|start_header_id|>tool<|end_header_id|>\n\n"
    "<tool_response>{{ message['content'] }}</tool_response><|eot_id|>"
    "{% else %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}<|eot_id|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""Llama-3 headers; with ``tools``, Hermes' tool format (the tools in the system turn, calls as
``<tool_call>{...}</tool_call>``, results in ``<tool_response>``): what vLLM's ``hermes``
parser reads (``TOOL_CALL_PARSER``). Without tools, plain Llama-3 turns."""

TOOL_CALL_PARSER = "hermes"
"""The tool-call parser that fits the template; the tiny servers are started with it."""

_SUBJECTS = "the cat|a dog|my friend|the teacher|our team|the city|a bird|the river|she|he|we|they"
_VERBS = "sees|likes|builds|finds|reads|writes|carries|paints|visits|answers|opens|follows"
_OBJECTS = (
    "a book|the door|an apple|the map|a song|the question|a letter|the garden|the road|"
    "a small house|the old tree|a bright star|the capital of France|the blue sea"
)
_TAILS = (
    "today|in the morning|at night|with care|again|near the window|after lunch|"
    "before the rain|every day|in Paris|quickly|slowly"
)


_SYLLABLES = "ka|lo|ren|mi|sta|vor|el|an|tri|bu|sen|da|ol|pe|ru|ix|na|gor|fe|lin|qu|ta|zel|mo"


def _sentences(count: int, seed: int) -> Iterator[str]:
    """English-like sentences; invented names and numbers widen the vocabulary BPE learns."""
    rng = random.Random(seed)
    parts = [group.split("|") for group in (_SUBJECTS, _VERBS, _OBJECTS, _TAILS)]
    syllables = _SYLLABLES.split("|")
    for _ in range(count):
        words = [rng.choice(options) for options in parts]
        name = "".join(rng.choice(syllables) for _ in range(rng.randint(2, 3))).capitalize()
        words.insert(rng.randint(0, len(words)), f"{name} {rng.randint(0, 9999)}")
        yield f"{' '.join(words).capitalize()}{rng.choice(['.', '.', '!', '?'])}"


def _build_tokenizer(vocab_size: int) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_sentences(20_000, seed=0)), trainer)
    # Plain completions get a BOS like Llama's; the chat template writes its own.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=EOS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def _build(dest: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _build_tokenizer(vocab_size=2000)
    tokenizer.save_pretrained(dest)  # type: ignore[attr-defined]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (BOS, EOS, EOT)}  # type: ignore[attr-defined]
    vocab = -(-len(tokenizer) // 64) * 64  # type: ignore[arg-type]
    config = LlamaConfig(
        vocab_size=vocab,
        **TINY_SHAPE,
        bos_token_id=ids[BOS],
        eos_token_id=[ids[EOT], ids[EOS]],
        pad_token_id=ids[EOS],
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Random weights give near-uniform logits, and greedy decoding then flips between
        # near-tied tokens with bf16 rounding (batch shape, prefix-cache hits). Sharper logits
        # make greedy output reproducible, so tests can compare answers token for token.
        model.lm_head.weight.mul_(25.0)
    model = model.bfloat16()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=[ids[EOT], ids[EOS]], pad_token_id=ids[EOS]
    )
    model.save_pretrained(dest)


def recipe_of(*modules: Path) -> str:
    """Changes whenever one of the modules does, so a stale cached folder gets rebuilt."""
    digest = hashlib.blake2b(digest_size=8)
    for module in modules:
        digest.update(module.read_bytes())
    return digest.hexdigest()


def _is_current(dest: Path, recipe: str) -> bool:
    marker = dest / READY_MARKER
    return marker.is_file() and marker.read_text().strip() == recipe


def build_tiny_llama(dest: Path) -> Path:
    """Create the tiny model folder at ``dest`` unless an up-to-date one is already there."""
    return build_once(dest, recipe_of(Path(__file__)), _build)


def build_once(dest: Path, recipe: str, build: Callable[[Path], None]) -> Path:
    """``build`` a model folder into ``dest`` atomically, unless one of ``recipe`` is there."""
    if _is_current(dest, recipe):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # One build at a time across processes (parallel test workers): a second builder would
    # swap the folder out from under a server already reading it.
    with (dest.parent / f".{dest.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_current(dest, recipe):
            return dest
        _build_into(dest, recipe, build)
    return dest


def _build_into(dest: Path, recipe: str, build: Callable[[Path], None]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    old = tmp.with_name(f"{tmp.name}.old")
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        (tmp / READY_MARKER).write_text(f"{recipe}\n")
        with contextlib.suppress(FileNotFoundError):
            dest.rename(old)  # stale or unfinished: swap it out, then drop it
        try:
            tmp.rename(dest)
        except OSError:
            if not _is_current(dest, recipe):  # unless a concurrent build just won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
