"""The TensorFlow seeds (000, 002, 004) through Keras: each notebook's code as written, next to multihead's
Keras layer holding the same weights (examples/seeds/seed00N_keras_tf.py; docs/seeds.md).

They need Keras's TensorFlow backend (the notebooks' own ``tf.*`` ops run inside Keras layers), so they run
in the ``KERAS_BACKEND=tensorflow`` process that ``test_compat_keras_env.py`` starts.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import runpy  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from seed_shapes import SEED002_SHAPE_LINES  # noqa: E402

keras = pytest.importorskip("keras")
if keras.backend.backend() != "tensorflow":
    pytest.skip(
        "the TensorFlow seeds run in the KERAS_BACKEND=tensorflow process "
        "(test_compat_keras_env.py::test_keras_tests_pass_on_the_other_backends[tensorflow])",
        allow_module_level=True,
    )
pytest.importorskip("tensorflow")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "seeds"


def _run_example(name, capsys):
    result = runpy.run_path(str(EXAMPLES / name))["main"]([])
    return result, capsys.readouterr().out


def test_seed000_reproduced_and_its_three_bugs_shown(capsys):
    res, printed = _run_example("seed000_keras_tf.py", capsys)
    assert res["output"].shape == (64, 5, 512) and "shape=(64, 5, 512), dtype=float32)" in printed
    assert res["diff"] < 1e-5  # the notebook's math (no mask) == ours with its weights, 8 heads of 8
    assert res["head_width_with_4_heads"] == 16  # the global h: 64 / 4, where 512 / 4 = 128 was meant
    assert "(512, 64) query kernel, 8 heads of 8; intended (512, 8, 64), 8 heads of 64" in printed
    assert res["nan_share"] == 1.0  # -inf * 0 = NaN everywhere
    assert np.isfinite(res["causal"]).all() and res["mask_diff"] < 1e-5


def test_seed002_shapes_reproduced_merge_and_mask_bugs_shown(capsys):
    res, printed = _run_example("seed002_keras_tf.py", capsys)
    lines = SEED002_SHAPE_LINES
    assert printed.splitlines()[: len(lines)] == lines  # the notebook's output, line for line
    assert res["scores_diff"] < 1e-5 and res["fixed_diff"] < 1e-5  # right up to the merge, and after the fix
    assert res["bug_diff"] > 0.1  # the merge without the transpose changes the output
    assert (res["as_commented"][..., 0, 0] == 0).all()  # tril as advised: query 0 may not see itself ...
    assert res["causal_diff"] < 1e-5  # ... while 1 - tril is our causal mask


def test_seed004_reproduced_and_zero_valid_len_shown(capsys):
    res, printed = _run_example("seed004_keras_tf.py", capsys)
    assert printed.splitlines()[0] == "TensorShape([2, 4, 100])"
    for out_diff, weight_diff in res["diffs"].values():  # valid_lens (B,) and (B, Lq)
        assert out_diff < 1e-5 and weight_diff < 1e-5
    np.testing.assert_allclose(res["d2l_row"], np.full(6, 1 / 6), rtol=1e-6)  # uniform over padding too
    assert np.abs(res["d2l_zero_len"]).max() > 0.1 and not res["ours_zero_len"].any()
