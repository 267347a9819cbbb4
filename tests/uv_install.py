"""Install requirements with uv, under pip's own configuration (`make venv`; pip installs when this fails).

pip unpacks and byte-compiles one file at a time, on one core; uv does both on every core
(requirements-dev.txt into a fresh venv on the shared 2-core machine: pip 126 s, uv 79 s with its own
install; docs/development.md). The .pyc are written at install, as pip writes them: PYTHONDONTWRITEBYTECODE
may be set, and then every process importing torch, TensorFlow and JAX from source costs 24 s of CPU, not 10.

uv reads no pip configuration, so the index URLs, find-links and constraints pip would use here (its config
files and PIP_* variables, as ``pip config list`` shows them; on the CI machine torch's CPU build comes from
find-links) are handed to uv as its options, and uv looks for the best version across all indexes, as pip
does (``--index-strategy unsafe-best-match``).

    python tests/uv_install.py -r requirements-dev.txt   (into this interpreter's environment)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

UV = "uv==0.13.9"
#: pip's configuration name -> uv's option (each of a value's space-separated items: one option)
OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
#: where pip reads a name, lowest precedence first: the config files' global and install sections, then
#: the PIP_* environment variables
SCOPES = ("global", "install", ":env:")


def pip_options(listing: str) -> list[str]:
    """uv's options for the settings in ``listing`` (``pip config list``'s output: ``scope.name='value'``
    a line); for a name set in several scopes, the one pip obeys."""
    found: dict[str, tuple[int, str]] = {}  # name -> (precedence, value)
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        if name in OPTIONS and scope in SCOPES:
            rank = SCOPES.index(scope)
            if rank >= found.get(name, (-1, ""))[0]:
                found[name] = (rank, value.strip().strip("'\""))
    return [
        arg for name, (_, value) in found.items() for item in value.split() for arg in (OPTIONS[name], item)
    ]


def main(argv: list[str]) -> int:
    py = sys.executable
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile", UV]
    if subprocess.run(pip).returncode:
        print("uv_install: uv could not be installed", file=sys.stderr)
        return 1
    listing = subprocess.run([py, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    uv = Path(py).parent / "uv"
    # uv's cache goes inside the venv, so its unpacked wheels are hard-linked into site-packages (the same file
    # system), then it is dropped: the install holds one copy of each file at every moment, with no download
    # temp beside it (docs/development.md, "Disk"). A cache elsewhere is a second copy of everything.
    cache = Path(sys.prefix) / ".uv-cache"
    cmd = [str(uv), "pip", "install", "-q", "--python", py, "--compile-bytecode", "--cache-dir", str(cache)]
    cmd += ["--link-mode", "hardlink", "--index-strategy", "unsafe-best-match", *pip_options(listing), *argv]
    try:
        return subprocess.run(cmd).returncode
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
