"""Model options that a model cannot take are refused by name before anything is built,
and a model that cannot take the data set's samples is refused before a run writes."""

from __future__ import annotations

import math

import pytest
import torch

from splitfed.cli import main
from splitfed.errors import ConfigError
from splitfed.limits import MAX_MODEL_PARAMS
from splitfed.models import MODELS, build_model

IMAGE = (1, 28, 28)
TOKENS = (2, 16)


@pytest.mark.parametrize("name, options, key", [
    ("alexnet", {"width": math.inf}, "model.width"),
    ("alexnet", {"width": math.nan}, "model.width"),
    ("alexnet", {"width": "wide"}, "model.width"),
    ("alexnet", {"width": 0}, "model.width"),
    ("vgg11", {"width": math.inf}, "model.width"),
    ("resnet18", {"width": -1.0}, "model.width"),
    ("alexnet", {"dropout": 1.0}, "model.dropout"),
    ("alexnet", {"dropout": math.nan}, "model.dropout"),
    ("alexnet", {"dropout": "half"}, "model.dropout"),
    ("mobilenetv2", {"width_mult": math.inf}, "model.width_mult"),
    ("mobilenetv2", {"width_mult": "x"}, "model.width_mult"),
])
def test_image_model_options_out_of_range_name_the_key(name, options, key):
    with pytest.raises(ConfigError, match=rf"^{key}: (must be a|expected a float|expected an "
                                          rf"integer)"):
        build_model(name, IMAGE if name in ("alexnet", "mobilenetv2") else (3, 32, 32), 10,
                    **options)


@pytest.mark.parametrize("options, message", [
    ({"hidden_size": 0}, "model.hidden_size: must be a positive integer, got 0"),
    ({"hidden_size": 1.5}, "model.hidden_size: expected an integer, got 1.5 (float)"),
    ({"num_heads": 0}, "model.num_heads: must be a positive integer"),
    ({"num_layers": True}, "model.num_layers: expected an integer, got True (bool)"),
    ({"ffn_dim": -3}, "model.ffn_dim: must be a positive integer"),
    ({"vocab_size": 0}, "model.vocab_size: must be a positive integer"),
    ({"vocab_size": 3}, "model.vocab_size: must be at least 4"),
    ({"max_positions": -1}, "model.max_positions: must be a positive integer"),
    ({"max_positions": 15}, "model.max_positions: opt would have 15 positions, fewer than "
                            "the data's sequences of 16 tokens; give at least 16"),
    ({"hidden_size": 30}, "model.hidden_size: 30 is not a multiple of model.num_heads (4)"),
    ({"num_layers": 100_000}, "model.num_layers: opt would have 100000 decoder "
                                "blocks, more than the 1024 allowed"),
    ({"num_layers": 1000, "hidden_size": 4096}, "model: opt would have about"),
    ({"dropout": 5}, "model.dropout: must be a number in [0, 1)"),
    ({"dropout": math.nan}, "model.dropout: must be a number in [0, 1)"),
    ({"dtype": "float8"}, "model.dtype: must be one of"),
    ({"preset": "opt-66b"}, "model.preset: unknown preset"),
])
def test_opt_sizes_it_cannot_take_are_refused_before_it_is_built(options, message):
    pytest.importorskip("transformers")
    with pytest.raises(ConfigError) as e:
        build_model("opt", TOKENS, 2, **options)
    assert str(e.value).startswith(message), str(e.value)


def test_opt_size_estimate_is_the_built_models_parameter_count():
    """The parameter count checked before building equals the built model's, for a
    preset with a projection (word_embed_proj_dim != hidden_size) and without."""
    pytest.importorskip("transformers")
    from splitfed.models.transformer import PRESETS, opt_config, opt_params

    for preset, sizes in [("tiny", {}), ("tiny", {"hidden_size": 48, "num_hidden_layers": 2,
                                                  "ffn_dim": 40, "vocab_size": 300}),
                          ("opt-125m", {}), ("opt-350m", {})]:
        with torch.device("meta"):
            model = build_model("opt", TOKENS, 3, preset=preset,
                                **{k: v for k, v in [("hidden_size", sizes.get("hidden_size")),
                                                      ("num_layers",
                                                       sizes.get("num_hidden_layers")),
                                                      ("ffn_dim", sizes.get("ffn_dim")),
                                                      ("vocab_size", sizes.get("vocab_size"))]
                                   if v is not None})
        values = dict(PRESETS[preset], **sizes)
        values.setdefault("max_position_embeddings", TOKENS[1])
        if values["word_embed_proj_dim"] is None:
            values["word_embed_proj_dim"] = values["hidden_size"]
        assert opt_config(3, TOKENS[1], preset=preset, **sizes) is not None
        assert opt_params(values, 3) == sum(p.numel() for p in model.parameters()), preset
    assert MAX_MODEL_PARAMS == 2 * 10**9


def test_any_failure_of_a_model_builder_is_a_config_error(monkeypatch):
    def fragile(input_shape, num_classes, *, depth: int = 1):
        return 1 // (depth - 1)

    monkeypatch.setitem(MODELS, "fragile", fragile)
    with pytest.raises(ConfigError, match=r"^model.name: the builder of model 'fragile' "
                                          r"failed \(options \{'depth': 1\}\): "
                                          r"ZeroDivisionError"):
        build_model("fragile", IMAGE, 10, depth=1)


@pytest.mark.parametrize("extra", [["--dry-run"], []])
def test_a_model_that_cannot_take_the_data_is_refused_before_anything_is_written(
        tmp_path, capsys, extra):
    """Token ids into the image MLP of quick_digits: refused when the environment is
    built (the dry run and the run alike), with nothing written."""
    out = tmp_path / "runs"
    code = main(["run", "quick_digits", "data.name=synthetic_text", "data.num_train=200",
                 "data.num_test=50", f"out_dir={out}", "progress=false", "rounds=1", *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert "model.name: mlp cannot take the samples of data.name=synthetic_text" in err
    assert "torch.int64" in err and len(err.strip().splitlines()) == 1
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("hidden", [[0], [32, -1], "wide", [True], [1.5]])
def test_mlp_hidden_is_named_in_its_refusal(hidden):
    with pytest.raises(ConfigError, match=r"^model\.hidden: must be a list of positive "
                                          r"integers \(mlp"):
        build_model("mlp", (1, 8, 8), 10, hidden=hidden)
