"""Vision models (TDPFed's DNN and VGG8, pFedSOP's ResNet-18 and ResNet-9): shapes, parameter
counts, the config files' personal heads, and FedAvg rounds end to end."""

from __future__ import annotations

import fnmatch
import importlib.util
import math

import pytest
import torch

from fedexp.engine.runner import build_engine
from fedexp.errors import ConfigError
from fedexp.models.builder import build_model
from fedexp.models.flat import FlatModel
from fedexp.models.vision import dnn
from fedexp.models.vision import resnet9
from fedexp.models.vision import resnet18
from fedexp.models.vision import vgg8
from helpers import CONF
from helpers import compose_config

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")


def _shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ----------------------------------------------------------------------------- DNN
def test_dnn_has_tdpfeds_784x100_and_100x10_layers():
    net = dnn([1, 28, 28], 10)
    assert _shapes(net) == {
        "fc1.weight": (100, 784),
        "fc1.bias": (100,),
        "fc2.weight": (10, 100),
        "fc2.bias": (10,),
    }
    assert net(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    # any input is flattened: tabular rows too
    assert _shapes(dnn([30], 2, hidden=7))["fc1.weight"] == (7, 30)


# ----------------------------------------------------------------------------- VGG8
TABLE_I = {  # TDPFed Table I, (in, out, kh, kw) there, PyTorch's (out, in, kh, kw) here
    "conv1.weight": (32, 3, 3, 3),
    "conv2.weight": (64, 32, 3, 3),
    "conv3.weight": (128, 64, 3, 3),
    "conv4.weight": (256, 128, 3, 3),
    "conv5.weight": (256, 256, 3, 3),
    "fc1.weight": (256, 256),
    "fc2.weight": (256, 256),
    "fc3.weight": (10, 256),
}


def test_vgg8_weights_are_table_i_on_cifar_inputs():
    shapes = _shapes(vgg8([3, 32, 32], 10))
    assert {k: v for k, v in shapes.items() if k.endswith(".weight")} == TABLE_I
    assert {k for k in shapes if k.endswith(".bias")} == {
        k.replace("weight", "bias") for k in TABLE_I
    }


@pytest.mark.parametrize(
    "shape,pools",
    [
        ([1, 8, 8], (True, True, True, False, False)),  # 8 -> 4 -> 2 -> 1, then no pooling
        ([1, 28, 28], (True, True, True, True, False)),  # 28 -> 14 -> 7 -> 3 -> 1
        ([3, 32, 32], (True,) * 5),  # 32 -> 1x1x256 after five pools
    ],
)
def test_vgg8_runs_on_digits_mnist_and_cifar_sizes(shape, pools):
    net = vgg8(shape, 10)
    assert net.pools == pools
    assert net(torch.randn(2, *shape)).shape == (2, 10)
    assert _shapes(net)["fc1.weight"] == (256, 256)  # always 256-in, whatever the input size


def test_vgg8_batch_norm_adds_running_statistics():
    plain = FlatModel(vgg8([3, 32, 32], 10), CPU)
    batch = FlatModel(vgg8([3, 32, 32], 10, norm="batch"), CPU)
    channels = 32 + 64 + 128 + 256 + 256
    assert not plain.has_buffers
    assert batch.layout.num_buffers == 2 * channels  # running mean and variance
    assert batch.layout.num_params == plain.layout.num_params + 2 * channels  # scale, shift
    logits, stats = batch.forward_train(batch.initial(), torch.randn(4, 3, 32, 32))
    assert logits.shape == (4, 10) and stats is not None


def test_image_models_refuse_tabular_inputs_and_bad_options():
    for build in (vgg8, resnet18, resnet9):
        with pytest.raises(ConfigError, match="image inputs"):
            build([30], 2)
    with pytest.raises(ConfigError, match="five convolutions"):
        vgg8([3, 32, 32], 10, channels=(8, 8, 8, 8))
    with pytest.raises(ConfigError, match="norm"):
        vgg8([3, 32, 32], 10, norm="layer")


# ----------------------------------------------------------------------------- ResNet-18
def test_resnet18_is_the_cifar_variant_with_11173962_parameters():
    net = resnet18([3, 32, 32], 10)
    assert _count(net) == 11_173_962  # the CIFAR ResNet-18's well-known count
    assert net.conv1.kernel_size == (3, 3) and net.conv1.stride == (1, 1) and net.no_max_pool
    flat = FlatModel(net, CPU)
    assert flat.has_buffers  # BatchNorm running statistics are in the flat vector
    bns = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert flat.layout.num_buffers == sum(2 * m.num_features for m in bns)
    net.eval()
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)


# ----------------------------------------------------------------------------- ResNet-9
def _resnet9_count(c: int, w: int, k: int) -> int:
    """Parameters of ResNet-9 from its layer list: ConvBN = 3x3 conv (no bias) + BN scale/shift."""

    def conv_bn(cin: int, cout: int) -> int:
        return 9 * cin * cout + 2 * cout

    layers = [
        conv_bn(c, w),  # prep
        conv_bn(w, 2 * w),  # layer1
        2 * conv_bn(2 * w, 2 * w),  # layer1 residual
        conv_bn(2 * w, 4 * w),  # layer2
        conv_bn(4 * w, 8 * w),  # layer3
        2 * conv_bn(8 * w, 8 * w),  # layer3 residual
        8 * w * k + k,  # fc
    ]
    return sum(layers)


@pytest.mark.parametrize("classes,width", [(100, 64), (10, 64), (200, 8)])
def test_resnet9_parameter_count_matches_its_layer_list(classes, width):
    net = resnet9([3, 32, 32], classes, width=width)
    count = _count(net)
    print(f"resnet9 width={width} classes={classes}: {count:,} parameters")
    assert count == _resnet9_count(3, width, classes)
    assert _shapes(net)["fc.weight"] == (classes, 8 * width)


def test_resnet9_runs_on_cifar_and_tiny_imagenet_sizes():
    net = resnet9([3, 32, 32], 100, width=8)
    for size in (32, 64, 8):
        net.train()
        assert net(torch.randn(2, 3, size, size)).shape == (2, 100)
    assert resnet9([3, 64, 64], 200, width=8)(torch.randn(2, 3, 64, 64)).shape == (2, 200)
    assert FlatModel(net, CPU).has_buffers


def test_resnet9_residual_is_added_to_the_input():
    """Zero the residual branch's last BN scale and shift: the block is then the identity."""
    net = resnet9([3, 32, 32], 10, width=4)
    block = net.layer3[2]
    with torch.no_grad():
        block.res2.bn.weight.zero_()
        block.res2.bn.bias.zero_()
    x = torch.randn(2, 32, 4, 4)
    assert torch.equal(block(x), x)


# ----------------------------------------------------------------------------- configs
OPTIONS = {  # option: (input shape, what the personal head is)
    "dnn": ([1, 28, 28], "fc2."),
    "vgg8": ([3, 32, 32], "fc3."),
    "resnet18": ([3, 32, 32], "fc."),
    "resnet9": ([3, 32, 32], "fc."),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_config_builds_seeded_and_personal_head_is_a_proper_subset(option):
    shape, head = OPTIONS[option]
    node = compose_config(f"model={option}").model
    module, personal = build_model(node, shape, 10, seed=0)
    layout = FlatModel(module, CPU).layout
    assert 0 < layout.indices(personal).numel() < layout.numel  # non-empty, proper subset
    for name in layout.names:
        assert any(fnmatch.fnmatchcase(name, p) for p in personal) == name.startswith(head), name
    again, _ = build_model(node, shape, 10, seed=0)
    other, _ = build_model(node, shape, 10, seed=1)
    first = FlatModel(module, CPU).initial()
    assert torch.equal(first, FlatModel(again, CPU).initial())
    assert not torch.equal(first, FlatModel(other, CPU).initial())


# ----------------------------------------------------------------------------- end to end
def _one_round(cfg):
    engine = build_engine(cfg)
    engine.setup()
    metrics = engine.run_round()
    aggregates, _ = engine.evaluate()
    return engine, metrics, aggregates


def test_fedavg_round_with_the_dnn_on_the_default_table(small_cfg):
    engine, metrics, aggregates = _one_round(small_cfg("model=dnn", "model.hidden=16"))
    assert engine.x0.numel() == 30 * 16 + 16 + 16 * 2 + 2  # 30 features, 2 logits
    assert not torch.equal(engine.server["x"], engine.x0)
    assert all(math.isfinite(v) for v in metrics.values())
    assert math.isfinite(aggregates["acc/mean"])


DIGITS = (CONF / "dataset" / "digits.yaml").exists() and bool(
    importlib.util.find_spec("fedexp.data.images")
)


@pytest.mark.skipif(not DIGITS, reason="dataset=digits is not in this tree")
def test_fedavg_round_with_vgg8_on_digits(small_cfg):
    cfg = small_cfg(
        "dataset=digits", "partition=shards", "model=vgg8", "local_steps=2", "batch_size=16"
    )
    engine, _, aggregates = _one_round(cfg)
    assert tuple(engine.clients[0].x_train.shape[1:]) == (1, 8, 8)
    assert not torch.equal(engine.server["x"], engine.x0)
    assert math.isfinite(aggregates["acc/mean"])


@pytest.mark.parametrize(
    "model",
    [
        ("model=vgg8", "model.channels=[4,4,8,8,8]", "model.hidden=8"),
        ("model=resnet9", "model.width=4"),
    ],
    ids=["vgg8", "resnet9"],
)
def test_fedavg_round_on_synthetic_luna16_patches(prepared, small_cfg, model):
    cfg = small_cfg(
        "dataset=luna16",
        f"dataset.path={prepared.luna}",
        *model,
        "partition=iid",
        "num_clients=3",
        "local_steps=2",
        "batch_size=8",
        "lr=0.05",
    )
    engine, _, aggregates = _one_round(cfg)
    flat = engine.ctx.model
    assert not torch.equal(engine.server["x"], engine.x0)
    if flat.has_buffers:  # ResNet-9: the averaged BatchNorm statistics moved too
        n = flat.layout.num_params
        assert not torch.equal(engine.server["x"][n:], engine.x0[n:])
    assert math.isfinite(aggregates["acc/mean"])


def test_vgg8_channels_last_row_by_row_equals_vmapped(prepared, small_cfg, monkeypatch):
    """No BatchNorm: the solver takes channels-last gradients row by row on the CPU; the
    channels-first vmapped computation gives the same round."""
    from fedexp.models.flat import FlatModel

    cfg = small_cfg(
        "dataset=luna16",
        f"dataset.path={prepared.luna}",
        "model=vgg8",
        "model.channels=[4,4,8,8,8]",
        "model.hidden=8",
        "partition=iid",
        "num_clients=3",
        "local_steps=2",
        "batch_size=8",
        "lr=0.05",
    )
    rows, _, _ = _one_round(cfg)
    assert rows.ctx.model.channels_last and rows.ctx.vmap_ok
    original = FlatModel.__init__
    monkeypatch.setattr(
        FlatModel,
        "__init__",
        lambda self, m, d, c=None, **k: original(self, m, d, channels_last=False, **k),
    )
    vmapped, _, _ = _one_round(cfg)
    assert not vmapped.ctx.model.channels_last and vmapped.ctx.vmap_ok
    torch.testing.assert_close(rows.server["x"], vmapped.server["x"], rtol=1e-4, atol=1e-5)
