"""torchvision and open_clip for the convert tests and docs, beside the CPU build of torch the dev venv pins.

Two facts make them live apart from the venv's other packages, in its folder ``vision``
(``pip install --no-deps --target .venv/vision -r requirements-vision.txt``):

* The torchvision wheels on PyPI are built against torch's CUDA build. Beside the CPU build (requirements-dev.txt:
  torch==2.13.0, the CPU wheel) their C++ ops (``nms``, ``roi_align``, image decoding) cannot load
  (``torchvision/_C.so`` links ``libtorch_cuda.so``). torchvision copes with that (``torchvision.extension.
  _has_ops()`` is then False) except in one place: 0.28.0's ``torchvision/_meta_registrations.py`` registers fake
  kernels for two of those ops, ``torchvision::nms`` and ``torchvision::qnms``, without checking, so ``import
  torchvision`` fails with "operator torchvision::nms does not exist". The models (``VisionTransformer``,
  open_clip's towers) use none of the ops.
* Hugging Face transformers imports torchvision whenever it can find it. In site-packages, that failing import
  would break every transformers test.

So only the code that wants them calls :func:`load`: it puts the folder on ``sys.path`` (after site-packages)
and imports torchvision; only when that import fails as above does it declare the two ops' schemas (no kernel:
calling them still raises, as it would anyway without the C++ library) and import again. Where the ops load
(torchvision beside the matching CUDA torch) the first import succeeds and nothing is declared. A transformers
imported later in the same process finds torchvision already imported, and working. README.md ("Tested
versions") and docs/compat.md say the same for users.
"""

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VISION = Path(sys.prefix) / "vision"  # the venv's folder for requirements-vision.txt
# the two ops that torchvision 0.28.0 registers fake kernels for at import, with their schemas
_SCHEMAS = {
    "torchvision::nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "torchvision::qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_declared: list[torch.library.Library] = []  # keeps the declarations alive for the process


def available(package):
    """Whether ``package`` (torchvision, open_clip) can be imported, with the vision folder on sys.path."""
    if VISION.is_dir() and str(VISION) not in sys.path:
        sys.path.append(str(VISION))
    return package in sys.modules or importlib.util.find_spec(package) is not None


def load():
    """``import torchvision`` beside the CPU torch; returns the module (see the module docstring)."""
    available("torchvision")
    try:
        import torchvision
    except RuntimeError as e:
        if "torchvision::" not in str(e) or "does not exist" not in str(e):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]  # the half-imported package, so the next import runs it again
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for qualname, schema in _SCHEMAS.items():
            lib.define(qualname.split("::")[1] + schema)
        _declared.append(lib)
        import torchvision
    return torchvision
