"""A secret that is no usable secret is refused where it is read, naming the file and never its
content: empty, a placeholder, no regular file (a directory, a FIFO that would block the read, a
device that never ends), unreadable, not UTF-8, a control character inside, or too large; and a token
variable set but empty, which would otherwise turn the token check off."""

import os

import pytest

from shared.rpc.auth import token_from_env
from shared.rpc.secret_files import MAX_SECRET_BYTES, PlaceholderSecret, read_secret


def refusal(path) -> str:
    with pytest.raises(PlaceholderSecret) as refused:
        read_secret(path, "the token")
    assert str(path) in str(refused.value)
    return str(refused.value)


def test_files_that_hold_no_usable_secret_are_refused(tmp_path):
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "nul").write_bytes(b"\x00" * 8)
    (tmp_path / "latin").write_bytes(b"caf\xe9-token")
    (tmp_path / "two-lines").write_text("first\nsecond\n")
    (tmp_path / "large").write_text("x" * (MAX_SECRET_BYTES + 1))
    (tmp_path / "blank").write_text(" \n\t\n")
    assert "cannot be opened: No such file" in refusal(tmp_path / "missing")
    assert "is no regular file" in refusal(tmp_path / "dir")
    assert "is no regular file" in refusal(tmp_path / "fifo")  # refused at once, not a read that blocks
    assert "is no regular file" in refusal(tmp_path / "zero")
    assert "control character" in refusal(tmp_path / "nul")
    assert "not UTF-8" in refusal(tmp_path / "latin")
    assert "control character" in refusal(tmp_path / "two-lines")
    assert f"over {MAX_SECRET_BYTES} bytes" in refusal(tmp_path / "large")
    assert "is empty" in refusal(tmp_path / "blank")
    (tmp_path / "good").write_text("  a-real-token-0123456789 \n")
    assert read_secret(tmp_path / "good", "the token") == "a-real-token-0123456789"
    secret = "a-real-token-0123456789"
    for name in ("nul", "latin", "two-lines"):  # the content is never echoed
        assert secret not in refusal(tmp_path / name) and "second" not in refusal(tmp_path / name)


def test_a_token_variable_set_but_empty_is_refused_and_unset_is_none(tmp_path, monkeypatch):
    monkeypatch.delenv("STEADYRL_TOKEN", raising=False)
    monkeypatch.delenv("STEADYRL_TOKEN_FILE", raising=False)
    assert token_from_env() is None  # no token configured: the loopback default of the tests
    monkeypatch.setenv("STEADYRL_TOKEN_FILE", "")
    with pytest.raises(PlaceholderSecret, match="STEADYRL_TOKEN_FILE is set but empty"):
        token_from_env()
    monkeypatch.delenv("STEADYRL_TOKEN_FILE")
    for value in ("", "   "):
        monkeypatch.setenv("STEADYRL_TOKEN", value)
        with pytest.raises(PlaceholderSecret, match="STEADYRL_TOKEN is empty"):
            token_from_env()
    monkeypatch.setenv("STEADYRL_TOKEN", " a-real-token ")
    assert token_from_env() == "a-real-token"


def test_the_control_plane_s_own_token_set_empty_is_refused(monkeypatch):
    from services.orchestrator.config import OrchestratorSettings

    monkeypatch.delenv("STEADYRL_TOKEN", raising=False)
    monkeypatch.delenv("STEADYRL_TOKEN_FILE", raising=False)
    settings = OrchestratorSettings(model_path="tiny", token="")
    with pytest.raises(PlaceholderSecret, match="the control plane's token, token is empty"):
        settings.bearer_token()
    assert OrchestratorSettings(model_path="tiny").bearer_token() is None
