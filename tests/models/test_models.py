"""Model factories: sized from the data, torchvision by name, user `_target_`, and clear refusals."""
import pytest
import torch
from torch import nn

from accutrain.errors import UserError
from accutrain.models.factories import build_model, cnn, mlp, torchvision_classifier


class TakesClasses(nn.Module):
    """A user model that takes some of the data-derived arguments and one of its own."""

    def __init__(self, num_classes: int, width: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.LazyLinear(width), nn.ReLU(), nn.Linear(width, num_classes))

    def forward(self, x):
        return self.net(x)


def test_mlp_and_cnn_take_the_data_shape():
    assert mlp(10, 1, 8, [16])(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    assert cnn(4, 3, [8, 16])(torch.zeros(3, 3, 5, 5)).shape == (3, 4)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "efficientnet_b0"])
def test_torchvision_models_are_sized_to_the_data(name):
    model = build_model({"_target_": "accutrain.models.torchvision_classifier", "name": name, "pretrained": False,
                         "small_input": None}, (1, 32, 32), 7)
    assert model(torch.zeros(2, 1, 32, 32)).shape == (2, 7)
    first_conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert first_conv.in_channels == 1


def test_small_input_gives_resnets_the_cifar_stem():
    small = torchvision_classifier("resnet18", 10, 3, 32)
    assert small.conv1.kernel_size == (3, 3) and small.conv1.stride == (1, 1)
    assert isinstance(small.maxpool, nn.Identity)
    large = torchvision_classifier("resnet18", 10, 3, 224)
    assert large.conv1.kernel_size == (7, 7)


def test_grey_input_keeps_a_pretrained_filters_response():
    """Summing pretrained RGB filters over channels answers a grey image as the RGB model would."""
    rgb = torchvision_classifier("resnet18", 10, 3, 64)
    first = rgb.conv1
    from accutrain.models.factories import _adapt_input_channels
    _adapt_input_channels(rgb, 1)
    grey = torch.rand(1, 1, 9, 9)
    torch.testing.assert_close(rgb.conv1(grey), first(grey.expand(1, 3, 9, 9)), rtol=1e-5, atol=1e-5)


def test_user_target_gets_the_data_arguments_it_accepts():
    model = build_model({"_target_": f"{__name__}.TakesClasses", "width": 5}, (1, 4, 4), 3)
    assert model.net[-1].out_features == 3 and model.net[1].out_features == 5


@pytest.mark.parametrize("cfg, message", [
    ({"_target_": "accutrain.models.torchvision_classifier", "name": "resnet19"}, "model.name='resnet19'"),
    ({"_target_": "no_such_module.Net"}, "cannot import it"),
    ({"_target_": "torch.nn.NoSuchNet"}, "torch.nn has no attribute 'NoSuchNet'"),
    ({"_target_": "torch.nn.Linear"}, "model._target_=torch.nn.Linear"),
    ({"_target_": "accutrain.models.mlp", "hidden": [4], "width": 3}, "takes no argument 'width'"),
    ({"_target_": "accutrain.models.torchvision_classifier", "name": "vgg11"}, "does not take 1×8×8 inputs"),
])
def test_model_errors_are_one_line(cfg, message):
    with pytest.raises(UserError) as info:
        build_model(cfg, (1, 8, 8), 10)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_wrong_output_shape_is_refused():
    with pytest.raises(UserError, match=r"returns \(2, 64\) for a batch of 2, expected \(2, 10\)"):
        build_model({"_target_": "torch.nn.Flatten"}, (1, 8, 8), 10)


BROKEN = """
import torch.nn as nn

def fails_to_build(num_classes, in_channels, image_size):
    raise ValueError("no such layer size")

class FailsInForward(nn.Module):
    def __init__(self, num_classes, in_channels, image_size):
        super().__init__()
        self.fc = nn.Linear(in_channels * image_size ** 2, num_classes)

    def forward(self, x):
        raise NotImplementedError("forward is not written yet")
"""


@pytest.mark.parametrize("target, message", [
    ("broken.fails_to_build",
     "the model broken.fails_to_build raised ValueError: no such layer size while being built"),
    ("broken.FailsInForward", "the model broken.FailsInForward raised NotImplementedError: forward is not written yet "
                              "in forward, on a batch of 2 1×8×8 inputs"),
])
def test_a_model_of_your_own_that_raises_is_one_line_naming_it(tmp_path, monkeypatch, target, message):
    """Item 7: the cause stays attached, for train.log's full traceback."""
    (tmp_path / "broken.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(tmp_path)
    with pytest.raises(UserError) as info:
        build_model({"_target_": target}, (1, 8, 8), 10)
    assert str(info.value) == message and info.value.__cause__ is not None
