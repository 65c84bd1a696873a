"""models.py, forward.py and checkpoints.py: building VOLOs, the training forward, and the final model file."""

from __future__ import annotations

import pytest
import torch
from conftest import make_params
from torch import nn

from coarse2fine import checkpoints, forward, models
from coarse2fine.errors import UserError


def tiny_model(num_classes: int = 10, img_size: int = 32, **model_cfg):
    return models.build_model(make_params(model=model_cfg).model, num_classes, img_size)


def test_volo_custom_follows_the_config():
    model = tiny_model(
        num_classes=7, img_size=64, layers=[2, 1, 1, 1], embed_dims=[32, 64, 64, 64], num_heads=[1, 2, 2, 2],
        mlp_ratio=2.0, patch_size=4, drop_path=0.2,
    )
    # Stem stride 2 x patch 4: a 64 px image is an 8x8 grid of tokens, the pos_embed grid (NHWC).
    assert model.pos_embed.shape == (1, 8, 8, 64)
    assert model.head.out_features == 7
    stages = [stage for stage in model.network if isinstance(stage, nn.Sequential)]  # without the downsampling
    assert [len(stage) for stage in stages] == [2, 1, 1, 1]
    assert [[block.attn.num_heads for block in stage] for stage in stages] == [[1, 1], [2], [2], [2]]
    assert {block.mlp.fc1.out_features / block.mlp.fc1.in_features for stage in stages for block in stage} == {2.0}
    drop_path_rates = [module.drop_prob for module in model.modules() if hasattr(module, "drop_prob")]
    assert max(drop_path_rates, default=0.0) == pytest.approx(0.2)
    model.eval()
    assert model(torch.randn(3, 3, 64, 64)).shape == (3, 7)


def test_named_volo_is_timms_architecture_with_our_head_and_size():
    model = models.build_model(make_params(model={"name": "volo_d1_224", "drop_path": 0.1}).model, 10, 224)
    # D1: 4+4+8+2 blocks, dims 192/384; 26.6 M parameters with the 1000-class heads, 25.9 M with 10 classes.
    assert sum(p.numel() for p in model.parameters()) == 25_869_740
    assert model.pos_embed.shape == (1, 14, 14, 384)
    assert max(module.drop_prob for module in model.modules() if hasattr(module, "drop_prob")) == pytest.approx(0.1)
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 224, 224)).shape == (1, 10)


def test_train_forward_gives_class_and_token_logits_matching_inference():
    torch.manual_seed(0)
    model = tiny_model()
    train_forward = forward.TrainForward(model).train()
    # forward_train only runs in training mode; freeze the stem's BatchNorm statistics so both paths
    # compute the same function.
    model.patch_embed.eval()
    images = torch.randn(4, 3, 32, 32)
    output = train_forward(images)
    assert output.cls_logits.shape == (4, 10)
    assert output.aux_logits.shape == (4, 4, 10)  # 2x2 tokens
    torch.testing.assert_close(output.merged(), model(images))


def test_model_file_round_trip(tmp_path):
    torch.manual_seed(0)
    model = tiny_model(num_classes=3).eval()
    params = make_params()
    path = tmp_path / "out" / "model.pt"
    checkpoints.save_model_file(path, model, model_cfg=params.model, img_size=32, classes=["a", "b", "c"], stage="pretrain")

    payload = torch.load(path, weights_only=True)
    assert payload["model_cfg"]["layers"] == [1, 1, 1, 1]
    assert (payload["img_size"], payload["classes"], payload["stage"]) == (32, ["a", "b", "c"], "pretrain")

    loaded, info = checkpoints.load_model_file(path)
    assert not loaded.training
    assert info == {key: payload[key] for key in checkpoints.MODEL_FILE_KEYS if key != "model"}
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(images), model(images), rtol=0, atol=0)
    assert [p.name for p in path.parent.iterdir()] == ["model.pt"]  # no temporary left behind


@pytest.mark.parametrize("content", [None, b"", b"not a torch file", "truncated", "not a model dict"])
def test_unreadable_model_files_are_user_errors_naming_the_file(tmp_path, content):
    path = tmp_path / "model.pt"
    if content == "truncated":
        checkpoints.save_model_file(
            path, tiny_model(), model_cfg=make_params().model, img_size=32, classes=list("0123456789"), stage="x"
        )
        path.write_bytes(path.read_bytes()[:1000])
    elif content == "not a model dict":
        torch.save({"weights": torch.ones(2)}, path)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError, match=str(path)):
        checkpoints.load_model_file(path)


def test_atomic_save_leaves_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "last.pt"
    checkpoints.atomic_save({"epoch": 1}, path)
    with pytest.raises(Exception):
        checkpoints.atomic_save({"epoch": 2, "bad": lambda: None}, path)  # lambdas cannot be pickled
    assert torch.load(path, weights_only=True) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


# ------------------------------------------------------------------------------------ other timm families


@pytest.mark.parametrize(
    ("model_cfg", "img_size"),
    [({"name": "resnet10t"}, 32), ({"name": "resnet10t", "output_stride": 8}, 32), ({"name": "vit_tiny_patch16_224"}, 64)],
)
def test_any_timm_model_trains_through_the_train_forward(model_cfg, img_size):
    model = tiny_model(num_classes=5, img_size=img_size, **model_cfg)
    output = forward.TrainForward(model).train()(torch.randn(2, 3, img_size, img_size))
    assert output.aux_logits is None and output.cls_logits.shape == (2, 5)
    assert output.merged() is output.cls_logits
    if "output_stride" in model_cfg:  # dilated: a 4 x 4 feature map at 32 px instead of 1 x 1
        assert model.forward_features(torch.randn(1, 3, 32, 32)).shape[-2:] == (4, 4)


def save_weights(model: nn.Module, path, kind: str) -> None:
    state = model.state_dict()
    if kind == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
    elif kind == "state_dict":
        torch.save(state, path)
    else:  # a training checkpoint of timm's train.py: the weights under "state_dict", EMA weights beside them
        torch.save({"epoch": 3, "state_dict": {f"module.{key}": value for key, value in state.items()}}, path)


@pytest.mark.parametrize("kind", ["safetensors", "state_dict", "checkpoint"])
def test_local_weights_load_strictly_into_the_named_architecture(tmp_path, kind):
    torch.manual_seed(0)
    source = tiny_model(num_classes=10, name="resnet10t")
    path = tmp_path / ("weights.safetensors" if kind == "safetensors" else "weights.pt")
    save_weights(source, path, kind)
    target = tiny_model(num_classes=10, name="resnet10t")
    checkpoints.load_weights(target, path, "teacher.weights")
    for key, value in source.state_dict().items():
        torch.testing.assert_close(target.state_dict()[key], value, rtol=0, atol=0)


def test_weights_that_do_not_fit_are_one_error_naming_the_file(tmp_path):
    path = tmp_path / "imagenet.safetensors"
    save_weights(tiny_model(num_classes=1000, name="resnet10t"), path, "safetensors")
    # timm would silently re-initialise a head of another class count; here it is an error.
    with pytest.raises(UserError) as error:
        checkpoints.load_weights(tiny_model(num_classes=10, name="resnet10t"), path, "teacher.weights")
    message = str(error.value)
    assert message.startswith(f"teacher.weights: {path} does not fit ResNet with 10 classes")
    assert "fc.weight (1000, 512) vs (10, 512)" in message and "\n" not in message
    with pytest.raises(UserError, match="missing .*unexpected"):  # another architecture altogether
        checkpoints.load_weights(tiny_model(num_classes=1000, name="resnet18"), path, "teacher.weights")
    with pytest.raises(UserError, match="weights file not found"):
        checkpoints.load_weights(tiny_model(name="resnet10t"), tmp_path / "nope.pt", "teacher.weights")
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="garbage.pt: not a readable weights file"):
        checkpoints.load_weights(tiny_model(name="resnet10t"), tmp_path / "garbage.pt", "teacher.weights")


def test_the_token_models_are_exactly_timms_volo_architectures():
    """config.has_token_outputs goes by the name (volo_*), to validate params without importing timm."""
    import timm
    from timm.models import is_model_in_modules

    from coarse2fine.config import has_token_outputs

    names = timm.list_models()
    assert {name for name in names if is_model_in_modules(name, ["volo"])} == set(filter(has_token_outputs, names))
