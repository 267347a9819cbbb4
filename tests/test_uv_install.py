"""tests/uv_install.py hands pip's configuration to uv as pip would obey it (`make venv` installs with it)."""

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
