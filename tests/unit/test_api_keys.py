"""The API key file and the check both wires make (``server/auth.py``); the wires themselves are
tested against a real server in tests/integration/test_api_keys.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dietserve.runtime.errors import Unauthenticated
from dietserve.server.auth import ApiKeyFileError, ApiKeys, load_api_keys
from dietserve.server.config import ConfigError, add_server_flags, config_from_args

KEY, OTHER = "sk-first-0123456789", "sk-second-abcdef"


def _key_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys"
    path.write_text(text)
    return path


def test_key_file_skips_blank_lines_and_comments(tmp_path: Path) -> None:
    keys = ApiKeys.from_file(_key_file(tmp_path, f"# service A\n{KEY}\n\n   \n  {OTHER}  \n# {KEY}-retired\n"))
    for key in (KEY, OTHER):
        keys.check(f"Bearer {key}")
    with pytest.raises(Unauthenticated, match="invalid API key"):
        keys.check(f"Bearer {KEY}-retired")


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n   \n"], ids=["empty", "blank", "comments"])
def test_a_key_file_without_keys_is_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(ApiKeyFileError, match="holds no API key: write one key per line"):
        ApiKeys.from_file(_key_file(tmp_path, text))


def test_key_file_errors_never_quote_a_key(tmp_path: Path) -> None:
    with pytest.raises(ApiKeyFileError, match="line 2: a key may not contain spaces") as raised:
        ApiKeys.from_file(_key_file(tmp_path, f"{KEY}\nsk-with space\n"))
    assert "sk-" not in str(raised.value)
    with pytest.raises(ApiKeyFileError, match="cannot be read"):
        ApiKeys.from_file(tmp_path / "missing")
    assert KEY not in repr(ApiKeys([KEY])) and "1 keys" in repr(ApiKeys([KEY]))


@pytest.mark.parametrize("header, message", [
    (None, "needs an API key: send the header 'Authorization: Bearer KEY'"),
    ("", "needs an API key"),
    (KEY, "must read 'Bearer KEY'"),
    (f"Basic {KEY}", "must read 'Bearer KEY'"),
    (f"Bearer {KEY}x", "invalid API key"),
    (f"Bearer {KEY[:-1]}", "invalid API key"),
    ("Bearer ", "invalid API key"),
])
def test_missing_or_wrong_keys_are_refused_without_echoing_them(header, message) -> None:
    with pytest.raises(Unauthenticated, match=message) as raised:
        ApiKeys([KEY, OTHER]).check(header)
    assert "sk-" not in str(raised.value)


def test_the_scheme_is_case_insensitive() -> None:
    ApiKeys([KEY]).check(f"bearer {KEY}")


def test_api_key_file_flag(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    assert config_from_args(parser.parse_args([]), None).api_key_file is None
    assert load_api_keys(None) is None
    path = _key_file(tmp_path, KEY)
    config = config_from_args(parser.parse_args(["--api-key-file", str(path)]), None)
    assert config.api_key_file == path
    load_api_keys(config.api_key_file).check(f"Bearer {KEY}")
    with pytest.raises(ConfigError, match="--api-key-file .* is not a readable file"):
        config_from_args(parser.parse_args(["--api-key-file", str(tmp_path / "missing")]), None)
