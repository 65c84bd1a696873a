"""The params schema: the shipped file is valid, and each kind of user mistake is one line naming the key."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from coarse2fine.config import (
    Optimizer, ParamsError, RandAugmentSpec, TeacherWeight, flatten, load_params, parse_params,
)

ROOT = Path(__file__).resolve().parents[1]


def shipped() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def with_change(path: str, value) -> dict:
    raw = shipped()
    *parents, leaf = path.split(".")
    node = raw
    for key in parents:
        node = node[key]
    node[leaf] = value
    return raw


def spelled_out(raw: dict, prefix: str = "") -> set[str]:
    """The key paths a YAML mapping writes."""
    keys = set()
    for key, value in raw.items():
        keys |= spelled_out(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return keys


def test_shipped_params_are_valid_and_document_every_training_knob():
    knobs = set(flatten(load_params(ROOT / "params.yaml")))
    written = spelled_out(shipped())
    assert written <= knobs
    # pretrain documents every key of a training section (teacher and finetune write the ones they change).
    assert {key for key in knobs if key.startswith("pretrain.")} <= written
    # finetune writes every token-label key: `dvc exp run -S` overrides only keys the file writes (the ablations').
    assert {key for key in knobs if key.startswith("finetune.token_label.")} <= written


def test_fine_tuning_weighs_an_agreeing_teacher_half_as_much_as_pre_training():
    # A measured deviation (issue 56; docs/recipe.md, "Fine-tuning's teacher weight"): sail-sg/volo's fine-tuning
    # target, and pre-training here, weigh the teacher 0.5 where its top-1 is the label; the ImageNet profiles keep
    # that (tests/test_profiles.py).
    params = load_params(ROOT / "params.yaml")
    assert params.pretrain.token_label.teacher_weight == TeacherWeight(agrees=0.5, disagrees=0.1)
    assert params.finetune.token_label.teacher_weight == TeacherWeight(agrees=0.25, disagrees=0.1)


def test_teacher_quality_arms_set_only_keys_params_yaml_writes(monkeypatch: pytest.MonkeyPatch):
    # `dvc exp run -S` refuses a key params.yaml does not write, which a bench arm would meet only after the seed's
    # ground-truth arm and teacher had run (10-20 minutes on 2 cores).
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    arms = importlib.import_module("teacher_quality").ARMS
    written = spelled_out(shipped())
    assert not {arm: key for arm, settings in arms.items() for key in settings if key not in written}


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("pretrain.optimizer.lr_base", -1.0, "pretrain.optimizer.lr_base: Input should be greater than 0 (got -1.0)"),
        ("pretrain.epochs", "ten", "pretrain.epochs: Input should be a valid integer (got 'ten')"),
        # timm has adahessian too, but it needs a second backward graph (config.Optimizer says why it is not offered).
        ("pretrain.optimizer.name", "adahessian",
         "pretrain.optimizer.name: Input should be 'adamw', 'lamb', 'sgd' or 'kron' (got 'adahessian')"),
        ("data.subset", 1.5, "data.subset: Input should be less than or equal to 1 (got 1.5)"),
        ("data.subset", 0.0, "data.subset: Input should be greater than 0 (got 0.0)"),
        ("data.source", "s3", "data.source: Input should be 'digits', 'photos' or 'imagefolder' (got 's3')"),
        ("loader.mmap", "yes", "loader.mmap: Input should be 'auto', True or False (got 'yes')"),
        ("evaluate.batch_size", 0, "evaluate.batch_size: Input should be greater than 0 (got 0)"),
        ("pretrain.img_size", 36, "pretrain.img_size: 36 is not divisible by the model's token stride 8"),
        ("finetune.img_size", 36, "finetune.img_size: 36 is not divisible by the model's token stride 8"),
        ("evaluate.finetune.extra_sizes", [40, 33], "evaluate.finetune.extra_sizes: 33 is not divisible by the model's token stride 8"),
        ("augment.scale", [0.9, 0.1], "augment.scale: must be 0 < low <= high (got [0.9, 0.1])"),
        ("finetune.crop_scale", [0.8, 1.2], "finetune.crop_scale: upper bound must be <= 1 (got 1.2)"),
        ("model.name", "resnet50x", "model.name: 'resnet50x' is neither volo_custom nor a timm model; did you mean resnet50"),
        ("teacher.model.name", "volo_d9", "teacher.model.name: 'volo_d9' is neither volo_custom nor a timm model"),
        ("teacher.model.output_stride", 4, "teacher.model.output_stride: 4 is not 8, 16 or 32 of a CNN"),
        ("teacher.mode", "import", "teacher.weights: required when mode is 'import'"),
        ("pretrain.mode", "import", "pretrain.weights: required when mode is 'import'"),
        ("finetune.mode", "import", "finetune.weights: required when mode is 'import'"),
        ("token_labels.teacher_view", "crop", "token_labels.teacher_view: Input should be 'whole' or 'center'"),
        ("tracking.champion_alias", "latest", "tracking.champion_alias: 'latest' is reserved by MLflow's registry"),
        ("tracking.candidate_alias", "v3", "tracking.candidate_alias: 'v3' is reserved by MLflow's registry"),
        ("tracking.champion_alias", "candidate", "tracking: candidate_alias and champion_alias are both 'candidate'"),
        # Token labeling needs a prediction per token: a CNN student has none.
        ("model", {"name": "resnet18"}, "pretrain.token_label.enabled: model.name 'resnet18' has no per-token outputs"),
        # A named timm model has its own layout: the tiny VOLO's keys cannot apply to it.
        ("model", {"name": "volo_d1_224", "patch_size": 4, "embed_dims": [8, 8, 8, 8]},
         "model: embed_dims, patch_size: set the layout of volo_custom only; 'volo_d1_224' is built to timm's own layout"),
        ("teacher.model", {"name": "resnet10t", "mlp_ratio": 4.0}, "teacher.model.mlp_ratio: sets the layout of volo_custom only"),
        ("model.dropout", 0.1, "model.dropout: unknown key"),  # the tiny VOLO has no such knob
        ("model.name", "volo_d1_224", "model: layers, embed_dims, num_heads, mlp_ratio, patch_size: set the layout of volo_custom"),
        # The fine-tuning recipe's batch 240 under the linear rule: 1.6e-5 x 240 / 1024 = 3.75e-6 < min_lr 4e-6.
        ("finetune", {"batch_size": 240, "optimizer": {"lr_base": 1.6e-5}, "schedule": {"min_lr": 4e-6}},
         "finetune.optimizer.lr_base: the peak lr 3.75e-06 = lr_base 1.6e-05 x global batch 240 / 1024 (1 ranks) is at or "
         "below schedule.min_lr 4e-06"),
        ("finetune", {"optimizer": {"lr_base": 8e-6, "lr_scaling": "none"}, "schedule": {"min_lr": 4e-6}}, None),
        # Two ways of mixing batches at once: Mixup's targets are the ground truth, MixToken's the token labels.
        ("finetune.mixup", {"mixup_alpha": 0.2}, "finetune.mixup: Mixup/CutMix mixes ground-truth targets, but finetune.token_label.enabled"),
        ("teacher.mixup", {"cutmix_alpha": 1.0, "prob": 0.5}, None),  # the teacher learns from the ground truth
        ("teacher.batch_size", 63, None),
        # The mesh's dimensions multiply to the world (1 rank here): one line naming the keys and their values.
        ("parallel.tensor", 2, "parallel: data auto x tensor 2 x pipeline 1 does not make the world of 1 ranks"),
        ("parallel", {"data": 2}, "parallel: data 2 x tensor 1 x pipeline 1 does not make the world of 1 ranks"),
        ("parallel.pipeline", 0, "parallel.pipeline: Input should be greater than 0 (got 0)"),
        ("parallel.schedule", "zb", "parallel.schedule: Input should be 'gpipe' or '1f1b' (got 'zb')"),
    ],
)
def test_bad_values_name_the_key(path, value, expected):
    if expected is None:  # valid as it is
        parse_params(with_change(path, value))
        return
    with pytest.raises(ParamsError) as error:
        parse_params(with_change(path, value))
    assert expected in str(error.value)
    assert str(error.value).startswith("params.yaml: ")


def test_kron_is_refused_under_fsdp_in_one_line():
    raw = with_change("parallel.strategy", "fsdp")
    raw["finetune"]["optimizer"]["name"] = "kron"
    with pytest.raises(ParamsError) as error:
        parse_params(raw)
    assert str(error.value) == (
        "params.yaml: finetune.optimizer.name: kron is not supported with parallel.strategy fsdp: use ddp"
    )


def test_token_labeling_off_means_mix_token_off_and_any_student():
    raw = with_change("pretrain.token_label.enabled", False)  # `dvc exp run -S pretrain.token_label.enabled=false`
    assert raw["pretrain"]["token_label"]["mix_token"] is True
    assert not parse_params(raw).pretrain.token_label.mixes_tokens
    raw["finetune"]["token_label"]["enabled"] = False
    raw["model"] = {"name": "resnet18"}  # without token labels, any timm model can be the student
    assert parse_params(raw).model.name == "resnet18"


def test_mixup_pairs_the_samples_of_a_batch():
    raw = with_change("teacher.mixup", {"mixup_alpha": 0.2})
    raw["teacher"]["batch_size"] = 63
    with pytest.raises(ParamsError, match=r"^params.yaml: teacher.batch_size: 63 is odd; Mixup/CutMix pairs the samples"):
        parse_params(raw)


def test_the_listing_stage_validates_params_without_importing_timm():
    """The source stage runs at every `dvc repro`: importing timm (and torch) would cost seconds each time."""
    program = (
        "import sys; from coarse2fine.config import load_params; "
        "params = load_params('params.yaml', check_model_names=False); "
        "assert params.teacher.model.name == 'resnet10t'; "
        "assert 'timm' not in sys.modules and 'torch' not in sys.modules, 'timm or torch imported'"
    )
    subprocess.run([sys.executable, "-c", program], cwd=ROOT, check=True, timeout=60)
    with pytest.raises(ParamsError, match="resnet10tt"):  # every other stage checks the names
        parse_params(with_change("teacher.model.name", "resnet10tt"))



def test_model_names_are_checked_from_the_users_cache_once_timm_listed_them(tmp_path):
    """convert checks every model name but builds no model: after one listing (which imports timm), a stage finds
    this timm installation's names in the cache and still catches a misspelt one, without importing timm."""
    program = (
        "import sys; from coarse2fine.config import ParamsError, load_params; "
        "load_params('params.yaml'); print('timm' in sys.modules); "
        "raw = __import__('yaml').safe_load(open('params.yaml')); raw['teacher']['model']['name'] = 'resnet10tt'; "
        "from coarse2fine.config import parse_params\n"
        "try: parse_params(raw)\n"
        "except ParamsError as error: print(error)"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    first, second = (
        subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True,
                       check=True, timeout=60).stdout.splitlines()
        for _ in range(2)
    )
    assert first[0] == "True" and second[0] == "False"  # listed by timm, then read from the cache
    assert second[1] == first[1] and "teacher.model.name: 'resnet10tt' is neither" in second[1]
    (cache,) = (tmp_path / "coarse2fine").iterdir()
    assert "volo_d1_224" in cache.read_text().split()

def test_unknown_keys_are_errors_not_ignored():
    raw = shipped()
    raw["pretrain"]["optimiser"] = {"lr_base": 1.0}  # British spelling: a typo that must not be dropped
    raw["colour"] = "red"
    with pytest.raises(ParamsError) as error:
        parse_params(raw)
    assert str(error.value).splitlines() == [
        "params.yaml: pretrain.optimiser: unknown key",
        "params.yaml: colour: unknown key",
    ]


def test_imagefolder_needs_a_root():
    with pytest.raises(ParamsError, match=r"data.root: required when source is 'imagefolder'"):
        parse_params(with_change("data.source", "imagefolder"))


def test_broken_yaml_empty_and_missing_file(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(bad)
    for empty in ("", "# every key commented out\n"):  # would run silently on the schema's defaults
        bad.write_text(empty)
        with pytest.raises(ParamsError, match=r"params.yaml: empty \(no params\): restore it \(git checkout"):
            load_params(bad)
    with pytest.raises(ParamsError, match="file not found"):
        load_params(tmp_path / "missing.yaml")


def test_stage_exits_2_with_one_line_before_heavy_work(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(with_change("pretrain.optimizer.lr_base", -0.1)))
    result = subprocess.run(
        [sys.executable, str(ROOT / "stages" / "convert.py"), "--params", str(params), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {params}: pretrain.optimizer.lr_base: Input should be greater than 0 (got -0.1)"
    ]
    assert not (tmp_path / "out").exists()


RAND_AUGMENT_SUPPORTED = "(supported: rand-m<0..10>-n<ops>-mstd<float>-inc<0|1>)"
# augment.rand_augment value -> the message after the params file's name.
BAD_RAND_AUGMENT = {
    "rand-m12": "augment.rand_augment: magnitude m12 in 'rand-m12' is above timm's maximum 10",
    "rand-m9-p0.3": f"augment.rand_augment: cannot use 'p0.3' in 'rand-m9-p0.3' {RAND_AUGMENT_SUPPORTED}",
    "randaug-m9": f"augment.rand_augment: cannot use 'randaug' in 'randaug-m9' {RAND_AUGMENT_SUPPORTED}",
    "rand-m9.5": f"augment.rand_augment: cannot use 'm9.5' in 'rand-m9.5' {RAND_AUGMENT_SUPPORTED}",
}


def check_params(params: Path) -> tuple[int, list[str]]:
    """`python -m coarse2fine.cli PARAMS` (the check each stage runs before its workers): exit code, stderr lines."""
    result = subprocess.run(
        [sys.executable, "-m", "coarse2fine.cli", str(params)],
        capture_output=True, text=True, cwd=params.parent, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    return result.returncode, result.stderr.strip().splitlines()


@pytest.mark.parametrize("spec", BAD_RAND_AUGMENT)
def test_params_check_rejects_what_the_loaders_cannot_honour(tmp_path, spec):
    """augment.rand_augment is parsed fully by the schema: one line naming the key, exit 2."""
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(with_change("augment.rand_augment", spec)))
    assert check_params(params) == (2, [f"error: {params}: {BAD_RAND_AUGMENT[spec]}"])


def test_rand_augment_is_parsed_once_in_the_schema(tmp_path):
    """The YAML value stays the string (a DVC param, logged as is); the parsed spec, with timm's defaults for
    what the string leaves out, comes with the validated params."""
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(with_change("augment.rand_augment", "rand-m9-mstd0.5-inc1")))
    assert check_params(params) == (0, [])
    augment = parse_params(with_change("augment.rand_augment", "rand-m9-mstd0.5-inc1")).augment
    assert augment.rand_augment == "rand-m9-mstd0.5-inc1"
    assert augment.rand_augment_spec == RandAugmentSpec(
        text="rand-m9-mstd0.5-inc1", num_ops=2, magnitude=9, magnitude_std=0.5, increasing=True
    )
    assert parse_params(with_change("augment.rand_augment", "rand-n3")).augment.rand_augment_spec == RandAugmentSpec(
        text="rand-n3", num_ops=3, magnitude=10, magnitude_std=0.0, increasing=False
    )
    assert parse_params(with_change("augment.rand_augment", "")).augment.rand_augment_spec is None
    assert flatten(parse_params(with_change("augment.rand_augment", "rand-m7")))["augment.rand_augment"] == "rand-m7"


def test_flatten_and_lr_scaling():
    flat = flatten(parse_params({}))
    assert flat["pretrain.optimizer.lr_base"] == 1.6e-2
    assert flat["model.layers"] == [1, 1, 1, 1]
    assert Optimizer(lr_base=1.6e-3).peak_lr(1024) == pytest.approx(1.6e-3)
    assert Optimizer(lr_base=1.6e-2).peak_lr(64) == pytest.approx(1e-3)
    assert Optimizer(lr_base=8e-6, lr_scaling="none").peak_lr(64) == 8e-6  # the reference's fine-tuning LR
