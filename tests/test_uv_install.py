"""tests/uv_install.py hands pip's configuration to uv as pip would obey it (`make venv` installs with it)."""

import pytest
import uv_install  # tests/uv_install.py

LISTING = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.find-links='/env/wheels'
global.constraint='/etc/pip/constraints.txt'
global.extra-index-url='file:///a/simple file:///b/simple'
global.find-links='/config/wheels'
install.index-url='https://mirror.example/simple'
global.index-url='https://ignored.example/simple'
"""


def test_pip_options_follow_pips_precedence_and_split_lists():
    args = uv_install.pip_options(LISTING)
    pairs = sorted(zip(args[0::2], args[1::2]))
    assert pairs == sorted([
        ("--find-links", "/env/wheels"),  # PIP_FIND_LINKS overrides the config file's
        ("--constraint", "/etc/pip/constraints.txt"),
        ("--extra-index-url", "file:///a/simple"),
        ("--extra-index-url", "file:///b/simple"),
        ("--index-url", "https://mirror.example/simple"),  # the install section overrides global
    ])  # fmt: skip


def test_no_pip_configuration_gives_no_options():
    assert uv_install.pip_options("") == []
    assert uv_install.pip_options(":env:.cert='/x'\nglobal.timeout='60'\n") == []


@pytest.mark.parametrize("status", [0, 3])
def test_uvs_cache_sits_in_the_venv_and_is_gone_after_the_install(monkeypatch, tmp_path, status):
    """The cache is inside the venv (the same file system, so its files are hard-linked, not copied) and is
    deleted afterwards, whether uv succeeds or fails (docs/development.md, "Disk")."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        if "--cache-dir" in cmd:  # uv's install: it fills its cache
            cache = cmd[cmd.index("--cache-dir") + 1]
            (tmp_path / "venv" / ".uv-cache" / "archive").mkdir(parents=True)
            assert cache == str(tmp_path / "venv" / ".uv-cache")
            return type("Done", (), {"returncode": status, "stdout": ""})()
        return type("Done", (), {"returncode": 0, "stdout": ""})()

    monkeypatch.setattr(uv_install.subprocess, "run", run)
    monkeypatch.setattr(uv_install.sys, "prefix", str(tmp_path / "venv"))
    assert uv_install.main(["-r", "requirements.txt"]) == status  # uv's own status comes back
    install = calls[-1]
    assert install[install.index("--link-mode") + 1] == "hardlink"
    assert install[-2:] == ["-r", "requirements.txt"]
    assert not (tmp_path / "venv" / ".uv-cache").exists()
