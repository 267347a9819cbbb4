"""multihead.compat.torch.convert / revert on real model code, random weights from small configs (no download):
torchvision's VisionTransformer, open_clip's CLIP (both towers), a plain nn.Transformer seq2seq model and a
model that nests nn.TransformerEncoder inside other modules.

Every check compares the converted model with the unconverted torch model in float64: outputs, gradients,
state_dict both ways (strict), torch.compile(fullgraph=True), and the head tools (viz.capture, heads.masked
against torch's model with the head's out_proj columns zeroed, heads.prune, heads.importance, the HTML report).
torchvision and open_clip come with requirements-vision.txt (tests/torchvision_env.py); where they are not
installed (the floor job) their cases skip, naming the package.
"""

import copy
import functools
import logging
from dataclasses import dataclass

import pytest
import torch
import torch._dynamo.testing
import torchvision_env
from torch import nn

from multihead import heads, viz
from multihead.compat.torch import MultiheadAttention, convert, revert

pytestmark = pytest.mark.usefixtures("one_thread")

DT = torch.float64
LOGGER = "multihead.compat.torch.convert"


def _needs(package):
    if not torchvision_env.available(package):
        pytest.skip(
            f"{package} is not installed (requirements-vision.txt, into {torchvision_env.VISION}; `make venv` "
            f"installs it, the floor job does not)"
        )
    torchvision_env.load()  # torchvision beside the CPU torch (tests/torchvision_env.py); open_clip imports it


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@dataclass
class Case:
    """A torch model, its inputs, how to call it, and the names of its nn.MultiheadAttention modules."""

    model: nn.Module
    inputs: tuple
    call: object  # (model, *inputs) -> Tensor
    attention: list
    build: object = None  # the function that made this case (another model of the same kind)

    def run(self, model):
        return self.call(model, *self.inputs)


def _vit():
    _needs("torchvision")
    from torchvision.models import VisionTransformer

    model = VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=5
    )
    nn.init.normal_(model.heads.head.weight)  # torchvision starts the classifier at zero: outputs all 0
    names = [f"encoder.layers.encoder_layer_{i}.self_attention" for i in range(2)]
    return Case(model.to(DT), (torch.randn(2, 3, 32, 32, generator=_gen(), dtype=DT),), _call, names)


def _clip():
    _needs("open_clip")
    import open_clip

    model = open_clip.CLIP(
        embed_dim=16,
        vision_cfg={"image_size": 32, "patch_size": 8, "layers": 2, "width": 32, "head_width": 16},
        text_cfg={"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 2},
    )
    images = torch.randn(2, 3, 32, 32, generator=_gen(), dtype=DT)
    texts = torch.randint(1, 64, (2, 8), generator=_gen(1))
    names = [
        f"{tower}.resblocks.{i}.attn" for tower in ("visual.transformer", "transformer") for i in range(2)
    ]
    return Case(model.to(DT), (images, texts), _clip_call, names)


def _clip_call(model, images, texts):
    return torch.cat([model.encode_image(images), model.encode_text(texts)], dim=-1)  # (B, 2 * embed_dim)


class Seq2Seq(nn.Module):
    """Token ids -> logits over a plain nn.Transformer (2 encoder layers, 1 decoder layer), pad id 0."""

    def __init__(self, vocab=11, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.transformer = nn.Transformer(d, 2, 2, 1, 32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, src, tgt):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=torch.bool)
        h = self.transformer(
            self.embed(src),
            self.embed(tgt),
            tgt_mask=causal,
            tgt_is_causal=True,
            src_key_padding_mask=src == 0,
            memory_key_padding_mask=src == 0,
        )
        return self.out(h)  # (B, T, V)


def _seq2seq():
    src = torch.randint(1, 11, (3, 7), generator=_gen())
    src[0, 5:] = 0  # padding
    tgt = torch.randint(1, 11, (3, 5), generator=_gen(1))
    names = [f"transformer.encoder.layers.{i}.self_attn" for i in range(2)]
    names += ["transformer.decoder.layers.0.self_attn", "transformer.decoder.layers.0.multihead_attn"]
    return Case(Seq2Seq().to(DT), (src, tgt), _call, names)


class Pool(nn.Module):
    """Attention pooling: one query (learned, plus the mean of ``h``) attends over the raw inputs ``x``, of
    another width (an nn.MultiheadAttention with kdim/vdim != embed_dim, outside torch's Transformer classes)."""

    def __init__(self, d):
        super().__init__()
        self.query = nn.Parameter(torch.randn(1, 1, d))
        self.attn = nn.MultiheadAttention(d, 4, kdim=8, vdim=8, batch_first=True)

    def forward(self, h, x):
        out, _ = self.attn(self.query + h.mean(dim=1, keepdim=True), x, x)  # (B, 1, d)
        return out[:, 0]


class Nested(nn.Module):
    """nn.TransformerEncoder inside a Sequential inside a ModuleDict, a second encoder sharing the first's
    layers, and attention pooling with kdim/vdim != embed_dim."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, norm_first=True)
        encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.towers = nn.ModuleDict({"text": nn.Sequential(nn.Linear(8, 16), encoder)})
        self.shared = self.towers["text"][1].layers[0]  # the same layer object, reached twice
        self.pool = Pool(16)

    def forward(self, x):
        h = self.shared(self.towers["text"](x))  # (B, L, 16)
        return self.pool(h, x)  # (B, 16)


def _nested():
    names = ["towers.text.1.layers.0.self_attn", "towers.text.1.layers.1.self_attn", "pool.attn"]
    return Case(Nested().to(DT), (torch.randn(2, 6, 8, generator=_gen(), dtype=DT),), _call, names)


def _call(model, *inputs):
    return model(*inputs)


CASES = {"torchvision vit": _vit, "open_clip": _clip, "nn.Transformer seq2seq": _seq2seq, "nested": _nested}


@pytest.fixture(params=list(CASES))
def case(request):
    torch.manual_seed(0)
    case = CASES[request.param]()
    case.build = CASES[request.param]
    return case


def _drop_ins(model):
    return {n for n, m in model.named_modules() if isinstance(m, MultiheadAttention)}


def _grads(model, out):
    """{parameter name: gradient of sum(out**2)}, for the parameters ``out`` depends on."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.square().sum(), [p for _, p in named], allow_unused=True)
    return {n: g for (n, _), g in zip(named, grads) if g is not None}


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_outputs_and_gradients_equal_torch(case, training):
    ref = case.model.train(training)
    ours = convert(ref)
    assert _drop_ins(ours) == set(case.attention)
    assert not any(type(m) is nn.MultiheadAttention for m in ours.modules())
    assert all(type(m) is nn.MultiheadAttention for n, m in ref.named_modules() if n in case.attention)
    want, got = case.run(ref), case.run(ours)
    torch.testing.assert_close(got, want)
    want_g, got_g = _grads(ref, want), _grads(ours, got)
    assert got_g.keys() == want_g.keys()
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], msg=name)
    with torch.no_grad():
        torch.testing.assert_close(case.run(ours), want)


def test_state_dict_loads_both_ways_and_revert_restores(case):
    ref = case.model.eval()
    ours = convert(ref)
    assert list(ours.state_dict()) == list(ref.state_dict())
    for key, value in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    # another torch model's weights into the converted one, and the converted one's into torch's
    torch.manual_seed(1)
    other = case.build().model.eval()
    ours.load_state_dict(other.state_dict(), strict=True)
    torch.testing.assert_close(case.run(ours), case.run(other))
    ref.load_state_dict(ours.state_dict(), strict=True)
    torch.testing.assert_close(case.run(ref), case.run(other))
    back = revert(ours)
    assert not _drop_ins(back) and _drop_ins(ours)  # revert copied; ours is untouched
    assert all(type(back.get_submodule(n)) is nn.MultiheadAttention for n in case.attention)
    assert list(back.state_dict()) == list(ref.state_dict())
    torch.testing.assert_close(case.run(back), case.run(other))


def test_compile_fullgraph_equals_eager(case):
    """One whole graph (fullgraph=True, one frame compiled) equal to torch's eager model. The aot_eager backend
    traces forward and backward graphs as inductor would and runs them without generating code (inductor's
    code generation is torch's own, and slow to compile on 2 cores)."""
    ours = convert(case.model.eval())
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(functools.partial(case.call, ours), fullgraph=True, backend=counter)
    try:
        got = compiled(*case.inputs)
    except torch._dynamo.exc.Unsupported:
        _skip_if_torchs_own_model_breaks_the_graph(case)
        raise
    torch.testing.assert_close(got, case.run(case.model))
    assert counter.frame_count == 1


def _skip_if_torchs_own_model_breaks_the_graph(case):
    """Before torch 2.9, nn.TransformerEncoder's nested-tensor check breaks the graph of torch's own model."""
    torch._dynamo.reset()
    try:
        torch.compile(functools.partial(case.call, case.model), fullgraph=True, backend="aot_eager")(
            *case.inputs
        )
    except torch._dynamo.exc.Unsupported as exc:
        pytest.skip(f"torch {torch.__version__}'s own unconverted model does not compile whole: {exc}"[:300])


def test_head_tools_work_on_the_converted_model(case, tmp_path):
    ref = case.model.eval()
    ours = convert(ref)
    with viz.capture(ours) as cap:
        base = case.run(ours)
    assert sorted(cap.names()) == sorted(case.attention)
    name = case.attention[-1]
    attn = ref.get_submodule(name)
    d = attn.embed_dim // attn.num_heads
    for record in cap.records:
        assert record.weights.shape[1] == ref.get_submodule(record.name).num_heads
        torch.testing.assert_close(record.weights.sum(-1), torch.ones_like(record.weights.sum(-1)))
    # masking head 0 equals torch's model with head 0's columns of out_proj zeroed
    zeroed = copy.deepcopy(ref)
    with torch.no_grad():
        zeroed.get_submodule(name).out_proj.weight[:, :d] = 0.0
    with heads.masked(ours, {name: [0]}):
        masked = case.run(ours)
    want = case.run(zeroed)
    torch.testing.assert_close(masked, want)
    assert not torch.allclose(masked, base)  # the mask took effect
    pruned = heads.prune(ours, {name: [0]})
    assert heads.head_counts(pruned)[name] == attn.num_heads - 1
    torch.testing.assert_close(case.run(pruned), want)
    scores = heads.importance(ours, [case.inputs], lambda m, batch: case.call(m, *batch).square().mean())
    assert sorted(scores) == sorted(case.attention)
    assert all(s.shape == (ref.get_submodule(n).num_heads,) and s.isfinite().all() for n, s in scores.items())
    tokens = [f"t{i}" for i in range(cap.records[0].weights.shape[-1])]
    first = case.attention[0]
    one = viz.Capture([r for r in cap.records if r.name == first])
    page = viz.write_report(
        tmp_path / "page.html", {"example": viz.panels(one, tokens, tokens)}, importance=scores
    )
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and first in html


def test_keeps_mode_requires_grad_dtype_and_with_inplace_the_parameter_objects(caplog):
    torch.manual_seed(0)
    model = Nested().to(DT).train()
    model.towers["text"][1].layers[1].eval()  # a mixed train/eval model
    model.pool.attn.q_proj_weight.requires_grad_(False)  # ... with a frozen projection
    modes = {n: m.training for n, m in model.named_modules()}
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    copied = convert(model)
    assert all(type(m) is nn.MultiheadAttention for n, m in model.named_modules() if n.endswith("attn"))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        same = convert(model, inplace=True)
    assert same is model and _drop_ins(model) == _drop_ins(copied) == set(_nested().attention)
    for converted in (copied, model):
        assert {n: m.training for n, m in converted.named_modules()} == modes
        for name, p in converted.named_parameters():
            assert (p.dtype, p.device, p.requires_grad) == (
                DT,
                params[name].device,
                params[name].requires_grad,
            )
    assert all(p is params[n] for n, p in model.named_parameters())  # inplace: the same Parameter objects
    assert model.shared is model.towers["text"][1].layers[0]  # a module reached twice stays one module
    model(_nested().inputs[0]).sum().backward()
    before = model.towers["text"][0].weight.detach().clone()
    optimizer.step()  # the optimizer built before convert still steps the converted model's parameters
    assert not torch.equal(model.towers["text"][0].weight, before)
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert record.levelno == logging.INFO and "3 module(s)" in record.getMessage()
    assert all(name in record.getMessage() for name in _nested().attention)


class MyLayer(nn.TransformerEncoderLayer):
    """A user's subclass of a torch class: its own code might read the attention's weights directly."""


class MyAttention(nn.MultiheadAttention):
    """A subclass with a parameter of its own, which the drop-in has no place for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.temperature = nn.Parameter(torch.ones(()))


def test_subclasses_are_left_alone_and_reported_unless_opted_in(caplog):
    model = nn.Sequential(
        MyLayer(16, 4, 32, batch_first=True), nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    )
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out = convert(model)
    assert _drop_ins(out) == {"1.self_attn"}
    warning = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1 and "0 (test_compat_convert.MyLayer)" in warning[0].getMessage()
    assert "subclasses=True" in warning[0].getMessage()
    assert _drop_ins(convert(model, subclasses=True)) == {"0.self_attn", "1.self_attn"}
    # a subclass of nn.MultiheadAttention converts with subclasses=True only if its parameters fit
    plain = nn.Sequential(nn.MultiheadAttention(16, 4), MyAttention(16, 4))
    assert _drop_ins(convert(plain)) == {"0"}
    with pytest.raises(ValueError, match=r"^1: MyAttention has parameters .*temperature.*subclasses=True"):
        convert(plain, inplace=True, subclasses=True)
    assert type(plain[0]) is nn.MultiheadAttention  # nothing changed, even with inplace=True


def test_the_model_itself_and_bad_arguments():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, add_bias_kv=True, add_zero_attn=True, dtype=DT).eval()
    ours = convert(mha, inplace=True)  # the root cannot change in place: the result is the new module
    assert type(ours) is MultiheadAttention and type(mha) is nn.MultiheadAttention
    x = torch.randn(3, 2, 8, dtype=DT)
    torch.testing.assert_close(ours(x, x, x)[0], mha(x, x, x)[0])
    assert type(revert(ours)) is nn.MultiheadAttention
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        convert("model")
    with pytest.raises(TypeError, match="inplace must be True or False, got 'yes'"):
        revert(mha, inplace="yes")
    with pytest.raises(TypeError, match="subclasses must be True or False, got 1"):
        convert(mha, subclasses=1)


def test_revert_refuses_pruned_modules_by_name_and_changes_nothing():
    model = convert(nn.Transformer(16, 4, 1, 1, 32, batch_first=True))
    pruned = heads.prune(model, {"decoder.layers.0.multihead_attn": [1]})
    with pytest.raises(ValueError, match=r"revert: decoder\.layers\.0\.multihead_attn lost heads to pruning"):
        revert(pruned, inplace=True)
    assert _drop_ins(pruned) == _drop_ins(model)
    with pytest.raises(ValueError, match="num_heads\\*head_dim=3\\*4 != embed_dim=16"):
        pruned.decoder.layers[0].multihead_attn.to_torch()


def test_requirements_vision_installs_what_the_dev_pins_lack_and_no_torch():
    """requirements-vision.txt is installed with --no-deps: each package's own requirements must then be met by
    the file itself or by the dev venv (torch included: torchvision 0.28.0 requires exactly the pinned torch)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    if not torchvision_env.VISION.is_dir():
        pytest.skip(f"{torchvision_env.VISION} is not there (requirements-vision.txt is not installed)")
    lines = [ln.split("#")[0].strip() for ln in open(torchvision_env.ROOT / "requirements-vision.txt")]
    pins = {canonicalize_name(ln.split("==")[0]): ln.split("==")[1] for ln in lines if ln}
    found = {
        canonicalize_name(d.metadata["Name"]): d
        for d in metadata.distributions(path=[str(torchvision_env.VISION)])
    }
    assert {n: d.version for n, d in found.items()} == pins
    for dist in found.values():
        for req in map(Requirement, dist.requires or []):
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue  # an optional extra of theirs
            if canonicalize_name(req.name) in pins:
                continue
            have = metadata.version(req.name)  # raises PackageNotFoundError if the dev venv lacks it
            assert req.specifier.contains(have, prereleases=True), (
                f"{dist.metadata['Name']} needs {req}, has {have}"
            )


@pytest.mark.parametrize("inplace", [False, True])
def test_a_module_registered_under_two_names_is_converted_once_and_stays_shared(inplace):
    """named_children() lists a shared child once; the second name must get the same drop-in too."""
    shared = nn.MultiheadAttention(16, 4, batch_first=True)
    model = nn.ModuleDict({"a": shared, "b": shared, "layer": nn.TransformerEncoderLayer(16, 4, 32)})
    model.layer.self_attn = shared  # and once more, inside a torch layer
    out = convert(model, inplace=inplace)
    assert type(out["a"]) is MultiheadAttention
    assert out["b"] is out["a"] and out["layer"].self_attn is out["a"]
    back = revert(out, inplace=inplace)
    assert type(back["a"]) is nn.MultiheadAttention
    assert back["b"] is back["a"] and back["layer"].self_attn is back["a"]
