"""Model zoo, cut points, auxiliary heads and the batched multi-client forward.

``build_model(name, input_shape, num_classes, **options)`` builds a :class:`BlockModel`;
``split(model, cut)`` gives its client and server parts (sharing the modules). Parameters
are initialised from torch's global RNG; for reproducible models wrap construction in
``with torch.random.fork_rng(): torch.manual_seed(seed); build_model(...)``.
ReLU activations are in place (as in torchvision; it saves memory traffic, ~30% faster
cohort training of LeNet-5 on CPU); every block starts with a conv, linear, pooling,
dropout or flatten layer, so neither split part ever modifies its input.

=============  ==========================  ===========  ======================================
name           options                     default cut  cut k means
=============  ==========================  ===========  ======================================
lenet5         -                           2            after block k (2: 2nd max-pool)
alexnet        width, dropout, init        2            after layer k of 8 (paper 001's Lc)
vgg11          batch_norm, width           3            after the k-th max-pool
resnet18       width                       2            after residual stage k (paper 002)
mobilenetv2    width_mult                  1            1: after the stem, k: after group k-1
mlp            hidden                      1            after hidden layer k
opt            preset, pretrained, sizes   2            embeddings + decoder blocks 1..k
=============  ==========================  ===========  ======================================
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from splitfed.configtools import typed_options
from splitfed.errors import ConfigError, describe, one_line
from splitfed.models.alexnet import alexnet
from splitfed.models.aux import build_aux_head
from splitfed.models.blocks import BlockModel, dry_output, output_shape, resolve_cut, split
from splitfed.models.cohort import cohort_forward, stack_states, unstack_state
from splitfed.models.lenet import lenet5
from splitfed.models.mlp import mlp
from splitfed.models.mobilenet import mobilenetv2
from splitfed.origins import component, origin, plugin_frame
from splitfed.models.resnet import resnet18
from splitfed.models.transformer import opt
from splitfed.models.vgg import vgg11

MODELS: dict[str, Callable[..., BlockModel]] = {
    "lenet5": lenet5,
    "alexnet": alexnet,
    "vgg11": vgg11,
    "resnet18": resnet18,
    "mobilenetv2": mobilenetv2,
    "mlp": mlp,
    "opt": opt,
}

__all__ = [
    "MODELS",
    "BlockModel",
    "build_aux_head",
    "build_model",
    "cohort_forward",
    "dry_output",
    "model_names",
    "output_shape",
    "resolve_cut",
    "split",
    "stack_states",
    "unstack_state",
]


def model_names() -> list[str]:
    """Names accepted by :func:`build_model`, sorted."""
    return sorted(MODELS)


def model_options(name: str) -> list[str]:
    """The keyword options of model ``name``."""
    params = inspect.signature(MODELS[name]).parameters.values()
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def _component(name: str) -> str:
    """``model 'name'``, with the plugin that registered it."""
    return component("model", name)


def _in_dry_run(e: BaseException) -> bool:
    """Whether ``e`` was raised while :func:`dry_output` ran a sample through a part of
    the model (the input shape does not fit the layers)."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is dry_output.__code__:
            return True
        tb = tb.tb_next
    return False


def _builder_failed(name: str, options: dict, e: BaseException) -> ConfigError:
    """The one-line error of a builder that raised ``e``; a plugin's ends with where in
    its code it happened, as its other components' failures do."""
    given = f" (options {options})" if options else ""
    at = plugin_frame(e) if origin("model", name) is not None else None
    return ConfigError(f"model.name: the builder of {_component(name)} failed{given}: "
                       f"{describe(e)}" + (f" (at {at})" if at else ""))


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, **options) -> BlockModel:
    """Build model ``name`` for per-sample ``input_shape`` and ``num_classes`` outputs.

    Unknown names, unknown options and input shapes the model cannot take raise
    :class:`ConfigError` listing what is allowed; any other failure of the builder raises
    one naming the model (and its plugin) and the builder's exception, and a builder that
    returns something other than a :class:`BlockModel` raises
    :class:`~splitfed.errors.PluginError`. Uses torch's global RNG for init.
    """
    if name not in MODELS:
        raise ConfigError(f"model.name: unknown model {name!r}; "
                          f"known models: {', '.join(model_names())}")
    unknown = sorted(set(options) - set(model_options(name)))
    if unknown:
        allowed = ", ".join(model_options(name)) or "none"
        raise ConfigError(f"model: unknown option(s) {unknown} for model {name}; "
                          f"allowed: {allowed}")
    options = typed_options(MODELS[name], options, "model")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError(f"num_classes must be a positive int, got {num_classes!r}")
    try:
        model = MODELS[name](tuple(input_shape), num_classes, **options)
    except ConfigError:
        raise
    except RuntimeError as e:
        if _in_dry_run(e):          # dry_output's run: the input (or an option) does not
            given = f" with the options {options}" if options else ""   # fit the layers
            raise ConfigError(f"model.name: input_shape {tuple(input_shape)} of the data "
                              f"does not fit {name}{given}: {one_line(e)}") from e
        raise _builder_failed(name, options, e) from e
    except Exception as e:  # noqa: BLE001 - the builder's own failure, reported as such
        raise _builder_failed(name, options, e) from e
    if not isinstance(model, BlockModel):
        from splitfed.errors import PluginError

        raise PluginError(f"model.name: the builder of {_component(name)} returned "
                          f"{type(model).__name__}, expected a splitfed.models.BlockModel "
                          "(named blocks, cut_descriptions, default_cut)")
    model.input_shape, model.num_classes = tuple(int(s) for s in input_shape), num_classes
    return model
