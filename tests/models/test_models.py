"""Model zoo: cuts, splits, auxiliary heads, configuration errors, parameter counts."""

import pytest
import torch
from torch import nn
from helpers import assert_float_close

from splitfed.errors import ConfigError
from splitfed.models import (
    BlockModel,
    build_aux_head,
    build_model,
    model_names,
    resolve_cut,
    split,
)

# (name, input_shape, small options)
CASES = [
    ("lenet5", (1, 28, 28), {}),
    ("lenet5", (3, 32, 32), {}),
    ("alexnet", (1, 28, 28), {"width": 0.125}),
    ("alexnet", (3, 32, 32), {"width": 0.125, "dropout": 0.5}),
    ("vgg11", (3, 32, 32), {"width": 0.125}),
    ("vgg11", (3, 32, 32), {"width": 0.125, "batch_norm": True}),
    ("resnet18", (3, 32, 32), {"width": 8}),
    ("mobilenetv2", (3, 32, 32), {"width_mult": 0.25}),
    ("mlp", (1, 28, 28), {"hidden": (32, 16)}),
    ("mlp", (60,), {}),
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny kernels: one thread avoids OpenMP contention on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


IDS = [f"{n}-{'x'.join(map(str, s))}-{i}" for i, (n, s, _) in enumerate(CASES)]


def _model(name, shape, opts, seed=0):
    torch.manual_seed(seed)
    return build_model(name, shape, 10, **opts)


def _num(module):
    return sum(p.numel() for p in module.parameters())


def test_every_model_is_covered():
    # opt takes token ids, not images: its split is checked in tests/test_llm.py
    assert {c[0] for c in CASES} == set(model_names()) - {"opt"}


@pytest.mark.parametrize("name,shape,opts", CASES, ids=IDS)
def test_split_composes_exactly_at_every_cut(name, shape, opts):
    model = _model(name, shape, opts).eval()
    x = torch.randn(4, *shape)
    with torch.no_grad():
        full = model(x)
        assert full.shape == (4, 10)
        for cut in model.valid_cuts:
            client, server = split(model, cut)
            assert len(client) == cut and len(server) == len(model) - cut
            acts = client(x)
            before = acts.clone()
            assert torch.equal(server(acts), full)
            assert torch.equal(acts, before)  # in-place activations never touch the input


@pytest.mark.parametrize("name,shape,opts", CASES, ids=IDS)
def test_split_parts_share_and_partition_parameters(name, shape, opts):
    model = _model(name, shape, opts)
    all_ids = {id(p) for p in model.parameters()}
    for cut in model.valid_cuts:
        client, server = split(model, cut)
        c_ids, s_ids = {id(p) for p in client.parameters()}, {id(p) for p in server.parameters()}
        assert c_ids and s_ids and not c_ids & s_ids
        assert c_ids | s_ids == all_ids
        keys = set(client.state_dict()) | set(server.state_dict())
        assert keys == set(model.state_dict())


@pytest.mark.parametrize("name,shape,opts", CASES, ids=IDS)
def test_aux_head_shapes(name, shape, opts):
    model = _model(name, shape, opts)
    client, _ = split(model)
    acts = client(torch.randn(4, *shape))
    for kind in ("linear", "mlp"):
        head = build_aux_head(client, shape, 10, kind=kind, hidden=16)
        assert head(acts).shape == (4, 10)


def test_aux_head_linear_is_one_layer_and_keeps_bn_stats():
    model = _model("resnet18", (3, 32, 32), {"width": 8})
    client, _ = split(model)
    before = {k: v.clone() for k, v in client.state_dict().items()}
    head = build_aux_head(client, (3, 32, 32), 10)
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 1 and linears[0].in_features == 16 * 16 * 16
    assert all(torch.equal(v, client.state_dict()[k]) for k, v in before.items())
    assert client.training
    with pytest.raises(ConfigError, match="linear, mlp"):
        build_aux_head(client, (3, 32, 32), 10, kind="conv")


def test_default_cuts_follow_the_papers():
    expected = {"lenet5": 2, "alexnet": 2, "vgg11": 3, "resnet18": 2, "mobilenetv2": 1, "mlp": 1}
    for name, shape, opts in CASES:
        model = _model(name, shape, opts)
        assert resolve_cut(model, None) == expected[name]
    lenet = _model("lenet5", (1, 28, 28), {})
    client, _ = split(lenet)
    assert client(torch.zeros(1, 1, 28, 28)).shape == (1, 16, 5, 5)
    assert resolve_cut(lenet, "conv2") == 2 and resolve_cut(lenet, "fc2") == 4


@pytest.mark.parametrize("cut", [0, 5, -1, 7, "fc3", "nope", 2.0, True, [2]])
def test_bad_cut_lists_valid_cuts(cut):
    model = _model("lenet5", (1, 28, 28), {})
    with pytest.raises(ConfigError) as err:
        split(model, cut)
    msg = str(err.value)
    assert "lenet5" in msg and "after 2nd max-pool, paper 003" in msg
    assert all(f"{k} (" in msg for k in (1, 2, 3, 4))


def test_model_without_cut():
    model = _model("mlp", (60,), {"hidden": ()})
    assert model.valid_cuts == [] and model(torch.zeros(2, 60)).shape == (2, 10)
    with pytest.raises(ConfigError, match="no valid cut"):
        split(model)


def test_unknown_model_and_option():
    with pytest.raises(ConfigError, match="lenet5.*mlp|mlp.*lenet5"):
        build_model("lenet7", (1, 28, 28), 10)
    with pytest.raises(ConfigError, match="allowed: batch_norm, width"):
        build_model("vgg11", (3, 32, 32), 10, batchnorm=True)
    with pytest.raises(ConfigError, match="allowed: none"):
        build_model("lenet5", (1, 28, 28), 10, width=2)
    with pytest.raises(ConfigError, match="image"):
        build_model("resnet18", (60,), 10)
    with pytest.raises(ConfigError, match="does not fit vgg11"):
        build_model("vgg11", (1, 16, 16), 10)
    with pytest.raises(ConfigError, match="num_classes"):
        build_model("mlp", (60,), 0)


def test_alexnet_init_he_by_default_torch_on_request():
    """He init: weights ~ N(0, 2 / fan_in), zero biases; "torch" keeps the layer defaults
    (uniform, variance 1 / (3 fan_in)); an unknown value names the field and the choices."""
    torch.manual_seed(0)
    he = build_model("alexnet", (1, 28, 28), 10, width=0.5)
    torch.manual_seed(0)
    plain = build_model("alexnet", (1, 28, 28), 10, width=0.5, init="torch")
    for a, b in zip(he.modules(), plain.modules()):
        if isinstance(a, (nn.Conv2d, nn.Linear)):
            fan_in, rel = a.weight[0].numel(), 4 * (2 / a.weight.numel()) ** 0.5  # 4 sigma
            assert a.weight.var().item() == pytest.approx(2 / fan_in, rel=rel)
            assert b.weight.var().item() == pytest.approx(1 / (3 * fan_in), rel=rel)
            assert not a.bias.any() and b.bias.any()
    with pytest.raises(ConfigError, match=r"model.init must be one of \['kaiming', 'torch'\]"):
        build_model("alexnet", (1, 28, 28), 10, init="xavier")


def test_build_is_deterministic_under_seed():
    a, b = (
        _model("alexnet", (1, 28, 28), {"width": 0.125}, 3),
        _model("alexnet", (1, 28, 28), {"width": 0.125}, 3),
    )
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert isinstance(a, BlockModel) and a.input_shape == (1, 28, 28) and a.num_classes == 10


def test_parameter_counts():
    # LeNet-5, 1x28x28 (conv1 padded): conv 6*1*25+6, 16*6*25+16; fc 400*120+120,
    # 120*84+84, 84*10+10
    lenet = build_model("lenet5", (1, 28, 28), 10)
    assert _num(lenet) == 156 + 2416 + 48120 + 10164 + 850 == 61706
    resnet = build_model("resnet18", (3, 32, 32), 10)
    assert _num(resnet) == 11_173_962
    assert _num(build_model("mobilenetv2", (3, 32, 32), 10)) == 2_236_682
    vgg = build_model("vgg11", (3, 32, 32), 10)
    client, _ = split(vgg)
    assert 0.09 < _num(client) / _num(vgg) < 0.11  # paper 003: ~10% on the client


@pytest.mark.parametrize("name, shape", [("lenet5", (60,)), ("alexnet", (2, 12)),
                                         ("vgg11", (3, 32)), ("resnet18", (60,)),
                                         ("mobilenetv2", (2, 10)), ("opt", (1, 8, 8)),
                                         ("opt", (3, 10))])
def test_a_model_given_data_of_another_shape_names_both_fields(name, shape):
    with pytest.raises(ConfigError) as e:
        build_model(name, shape, 10)
    assert str(e.value).startswith("model.name: "), e.value
    assert f"data.name gives samples of shape {shape}" in str(e.value)


def _block_outputs(model, shape):
    """Per-sample output shape of every block of ``model`` on one sample of ``shape``."""
    x, out = torch.zeros(1, *shape), {}
    with torch.no_grad():
        for name, block in model.eval().named_children():
            x = block(x)
            out[name] = tuple(x.shape[1:])
    return out


def test_resnet18_stages_halve_the_resolution_from_the_second_on():
    """Module doc: widths w, 2w, 4w, 8w at strides 1, 2, 2, 2 (CIFAR stem, no max-pool),
    so a 32x32 input leaves the stages at 32, 16, 8 and 4 pixels."""
    got = _block_outputs(_model("resnet18", (3, 32, 32), {"width": 4}), (3, 32, 32))
    assert got == {"stage1": (4, 32, 32), "stage2": (8, 16, 16), "stage3": (16, 8, 8),
                   "stage4": (32, 4, 4), "head": (10,)}


def test_alexnet_blocks_pool_after_conv1_conv2_and_conv5():
    """Module doc: max-pools after conv1, conv2 and conv5 (256x3x3 for 28x28 inputs), then
    1024 and 512 hidden units, every width scaled by ``width``."""
    got = _block_outputs(_model("alexnet", (1, 28, 28), {"width": 0.125}), (1, 28, 28))
    assert got == {"conv1": (8, 14, 14), "conv2": (24, 7, 7), "conv3": (48, 7, 7),
                   "conv4": (32, 7, 7), "conv5": (32, 3, 3), "fc1": (128,), "fc2": (64,),
                   "fc3": (10,)}


def test_vgg11_every_stage_ends_in_a_max_pool():
    """Module doc: five stages each ending in a max-pool, so a 32x32 input reaches the
    classifier as 512 x 1 x 1 (times ``width``)."""
    got = _block_outputs(_model("vgg11", (3, 32, 32), {"width": 0.125}), (3, 32, 32))
    assert got == {"stage1": (8, 16, 16), "stage2": (16, 8, 8), "stage3": (32, 4, 4),
                   "stage4": (64, 2, 2), "stage5": (64, 1, 1), "classifier": (10,)}


def test_mobilenetv2_strides_sit_on_the_first_block_of_each_group():
    """Module doc: stride 1 stem and groups of strides 1, 1, 2, 2, 1, 2, 1 (the stride on
    each group's first block), so 32x32 ends at 4x4; the last conv has
    1280 * max(1, width_mult) channels."""
    model = _model("mobilenetv2", (3, 32, 32), {"width_mult": 0.25})
    sizes = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: sizes.__setitem__(n, o.shape[-1]))
             for n, m in model.named_modules() if type(m).__name__ == "InvertedResidual"]
    with torch.no_grad():
        model.eval()(torch.zeros(1, 3, 32, 32))
    for h in hooks:
        h.remove()
    side = {1: 32, 2: 32, 3: 16, 4: 8, 5: 8, 6: 4, 7: 4}
    assert sizes and all(s == side[int(n.split(".")[0][5:])] for n, s in sizes.items()), sizes
    head_conv = model.head[0]
    assert head_conv.out_channels == 1280


def test_mobilenetv2_blocks_add_their_input_exactly_when_shapes_match():
    """An inverted residual adds its input when stride 1 and the channels match (module
    doc); with its last BatchNorm zeroed, the branch is 0, so the block returns its input
    then, and 0 otherwise."""
    from splitfed.models.mobilenet import InvertedResidual

    x = torch.randn(2, 8, 6, 6)
    for inp, out, stride, adds in [(8, 8, 1, True), (8, 16, 1, False), (8, 8, 2, False)]:
        block = InvertedResidual(inp, out, stride, 6).eval()
        with torch.no_grad():
            block.conv[-1].weight.zero_()
            block.conv[-1].bias.zero_()
            y = block(x)
        if adds:
            assert torch.equal(y, x)
        else:
            assert not y.any()


@pytest.mark.parametrize("name,shape,opts", [
    ("lenet5", (1, 28, 28), {}),
    ("alexnet", (1, 28, 28), {"width": 0.125}),
    ("vgg11", (3, 32, 32), {"width": 0.125, "batch_norm": True}),
    ("mlp", (60,), {"hidden": (16, 8)}),
])
def test_every_client_block_ends_in_a_relu(name, shape, opts):
    """The documented blocks end in ReLU (then possibly a max-pool), so the activation at
    every cut is non-negative, in training mode (batch statistics) as in eval mode, and
    not all zero."""
    model = _model(name, shape, opts)
    x = torch.randn(8, *shape)
    for training in (True, False):
        for cut in model.valid_cuts:
            client, _ = split(model, cut)
            with torch.no_grad():
                acts = client.train(training)(x)
            assert (acts >= 0).all() and (acts > 0).any(), (cut, training)


def test_alexnet_dropout_sits_before_fc1_and_fc2():
    """Module doc: ``dropout`` inserts Dropout(p) before fc1 and fc2 (and nowhere else)."""
    model = _model("alexnet", (1, 28, 28), {"width": 0.125, "dropout": 0.25})
    drops = {n: m.p for n, m in model.named_modules() if isinstance(m, nn.Dropout)}
    assert drops == {"fc1.1": 0.25, "fc2.0": 0.25}
    assert isinstance(model.fc1[2], nn.Linear) and isinstance(model.fc2[1], nn.Linear)


def test_aux_mlp_head_is_linear_relu_linear():
    """kind="mlp": Flatten, Linear(flat, hidden), ReLU, Linear(hidden, num_classes)
    (module doc), computed by hand from the head's own weights."""
    model = _model("lenet5", (1, 28, 28), {})
    client, _ = split(model)
    head = build_aux_head(client, (1, 28, 28), 10, kind="mlp", hidden=16)
    lin1, lin2 = [m for m in head.modules() if isinstance(m, nn.Linear)]
    assert (lin1.in_features, lin1.out_features, lin2.out_features) == (400, 16, 10)
    acts = torch.randn(4, 16, 5, 5)

    def want(dt):
        w1, b1, w2, b2 = (p.detach().to(dt) for p in (lin1.weight, lin1.bias, lin2.weight,
                                                       lin2.bias))
        return torch.relu(acts.to(dt).flatten(1) @ w1.T + b1) @ w2.T + b2
    with torch.no_grad():
        assert_float_close(head(acts), want(torch.float32), want(torch.float64), terms=400)
    for hidden in (0, -1, True, 2.0):
        with pytest.raises(ConfigError, match="hidden must be a positive int"):
            build_aux_head(client, (1, 28, 28), 10, kind="mlp", hidden=hidden)


def test_width_multipliers_round_channels_to_the_nearest_integer_at_least_one():
    """blocks.scaled: channels * width rounded to the nearest integer, at least 1 (VGG-11
    at width 0.3: 64 -> 19.2 -> 19, 128 -> 38.4 -> 38, 256 -> 76.8 -> 77, 512 -> 153.6
    -> 154)."""
    from splitfed.models.blocks import scaled

    assert [scaled(c, 0.3) for c in (64, 128, 256, 512)] == [19, 38, 77, 154]
    assert scaled(1, 0.1) == 1
    got = _block_outputs(_model("vgg11", (3, 32, 32), {"width": 0.3}), (3, 32, 32))
    assert [got[f"stage{i}"][0] for i in range(1, 6)] == [19, 38, 77, 154, 154]
