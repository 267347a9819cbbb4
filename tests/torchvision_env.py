"""torchvision (and so open_clip) importable beside the CPU build of torch that the dev environment pins.

The torchvision wheels on PyPI are built against torch's CUDA build. Beside the CPU build (requirements-dev.txt:
torch==2.13.0 from the CPU wheel) their C++ ops (``nms``, ``roi_align``, image decoding) cannot load:
``torchvision/_C.so`` links ``libtorch_cuda.so``. torchvision copes with that (``torchvision.extension._has_ops()``
is then False) except in one place: 0.28.0's ``torchvision/_meta_registrations.py`` registers fake kernels for
two of those ops, ``torchvision::nms`` and ``torchvision::qnms``, without checking, so ``import torchvision``
fails with "operator torchvision::nms does not exist". The models (``VisionTransformer``, open_clip's towers)
use none of the ops.

:func:`load` imports torchvision; only when it fails that way does it declare the two ops' schemas (no kernel:
calling them still raises, as it would anyway without the C++ library) and import again. Where the ops load
(torchvision beside the matching CUDA torch, as on the floor job's torch) the first import succeeds and nothing
is declared. README.md ("Tested versions") and docs/compat.md say the same for users.
"""

import sys

import torch

# the two ops that torchvision 0.28.0 registers fake kernels for at import, with their schemas
_SCHEMAS = {
    "torchvision::nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "torchvision::qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_declared: list[torch.library.Library] = []  # keeps the declarations alive for the process


def load():
    """``import torchvision`` on the CPU torch; returns the module (see the module docstring)."""
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
