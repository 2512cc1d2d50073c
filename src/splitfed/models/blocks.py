"""Block models and cut points.

A :class:`BlockModel` is an ``nn.Sequential`` of named blocks. A cut ``k`` is the number
of leading blocks that run on the client: ``blocks[:k]`` form the client-side model,
``blocks[k:]`` the server-side model. Valid cuts are ``1 .. len(blocks) - 1`` (both parts
non-empty); every model documents each of them with the name the papers use
(docs/design.md, "Models and cut points").
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import nn

from splitfed.errors import ConfigError


class BlockModel(nn.Sequential):
    """An ordered sequence of named blocks; a cut k puts blocks[:k] on the client,
    blocks[k:] on the server.

    ``cut_descriptions`` maps every valid cut to a human-readable description (used in
    error messages); ``default_cut`` is the papers' choice, ``None`` for a model that has
    no valid cut (one block).
    """

    def __init__(
        self,
        blocks: OrderedDict[str, nn.Module],
        *,
        name: str,
        cut_descriptions: dict[int, str],
        default_cut: int | None,
    ):
        super().__init__(blocks)
        self.name = name
        self.cut_descriptions = dict(cut_descriptions)
        self.default_cut = default_cut
        bad = [k for k in self.cut_descriptions
               if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < len(blocks)]
        if bad:
            raise ValueError(f"{name}: cuts {bad} are not 1..{len(blocks) - 1} (the model has "
                             f"{len(blocks)} blocks)")
        if default_cut is None and self.cut_descriptions:
            raise ValueError(f"{name}: default_cut is None, but the model has cuts "
                             f"{sorted(self.cut_descriptions)}; give one of them (None only "
                             "for a model without cuts)")
        if default_cut is not None and default_cut not in self.cut_descriptions:
            raise ValueError(f"{name}: default_cut {default_cut!r} is not one of its cuts "
                             f"{sorted(self.cut_descriptions)}")

    @property
    def valid_cuts(self) -> list[int]:
        """The valid cut indices, ascending."""
        return sorted(self.cut_descriptions)

    @property
    def block_names(self) -> list[str]:
        return [n for n, _ in self.named_children()]


def _cut_error(model: BlockModel, cut) -> ConfigError:
    if not model.valid_cuts:
        return ConfigError(f"model.cut={cut!r}: {model.name} has a single block and no valid "
                           "cut (use it with an unsplit algorithm)")
    listed = ", ".join(f"{k} ({model.cut_descriptions[k]})" for k in model.valid_cuts)
    names = ", ".join(f"'{n}'" for n in model.block_names[:-1])
    return ConfigError(
        f"model.cut={cut!r} is not valid for {model.name}; valid cuts: {listed}; "
        f"or the name of the last client block: {names}"
    )


def resolve_cut(model: BlockModel, cut: int | str | None) -> int:
    """The cut index for ``cut``.

    ``None`` gives the model's default cut; an int is the number of client blocks; a str
    names the block after which to cut. Anything invalid raises :class:`ConfigError`
    naming the model and listing every valid cut with its description.
    """
    given = cut
    if cut is None:
        cut = model.default_cut
    elif isinstance(cut, str):
        names = model.block_names
        cut = names.index(cut) + 1 if cut in names else cut
    if isinstance(cut, bool) or not isinstance(cut, int) or cut not in model.cut_descriptions:
        raise _cut_error(model, cut if given is None else given)   # the value as given
    return cut


def split(model: BlockModel, cut: int | str | None = None) -> tuple[nn.Sequential, nn.Sequential]:
    """(client part, server part) at ``cut`` (see :func:`resolve_cut`).

    Both parts are ``nn.Sequential`` over the model's own block modules (shared, not
    copied) under the same block names, so their ``state_dict`` keys are a partition of
    the model's keys.
    """
    k = resolve_cut(model, cut)
    children = list(model.named_children())
    return nn.Sequential(OrderedDict(children[:k])), nn.Sequential(OrderedDict(children[k:]))


def output_shape(module: nn.Module, input_shape: tuple[int, ...], n: int = 2) -> tuple[int, ...]:
    """Per-sample output shape of ``module`` by a dry run on ``n`` zero samples
    (:func:`dry_output`)."""
    return tuple(dry_output(module, input_shape, n).shape[1:])


def dry_output(module: nn.Module, input_shape: tuple[int, ...], n: int = 2) -> torch.Tensor:
    """``module``'s output for ``n`` zero samples of ``input_shape`` (in its parameters'
    dtype, on their device): its per-sample shape and its dtype.

    Runs without gradients and in eval mode (restored afterwards), so BatchNorm running
    statistics are not touched and no random numbers are drawn.
    """
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            p = next(module.parameters(), None)
            dtype = p.dtype if p is not None else torch.get_default_dtype()
            device = p.device if p is not None else None     # the module's (a GPU's)
            return module(torch.zeros(n, *input_shape, dtype=dtype, device=device))
    finally:
        for m, mode in modes:
            m.training = mode


def image_shape(model: str, input_shape) -> tuple[int, int, int]:
    """``input_shape`` as (channels, height, width); ConfigError if it is not an image."""
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ConfigError(f"model.name: {model} needs images, input_shape (channels, H, W); "
                          f"data.name gives samples of shape {shape}")
    return shape


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_multiplier(value, key: str, model: str = "") -> None:
    """ConfigError naming ``model.<key>`` unless ``value`` is a finite number > 0 (a
    width multiplier)."""
    if not _number(value) or not 0 < value < math.inf:
        of = f" ({model})" if model else ""
        raise ConfigError(f"model.{key}: must be a finite number > 0{of}, got {value!r}")


def check_dropout(value, model: str = "") -> None:
    """ConfigError naming ``model.dropout`` unless ``value`` is a number in [0, 1)."""
    if not _number(value) or not 0.0 <= value < 1.0:
        of = f" ({model})" if model else ""
        raise ConfigError(f"model.dropout: must be a number in [0, 1){of}, got {value!r}")


def scaled(channels: int, width: float) -> int:
    """``channels * width`` rounded, at least 1 (width multipliers of small models)."""
    check_multiplier(width, "width")
    return max(1, round(float(channels * width)))
