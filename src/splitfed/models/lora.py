"""LoRA adapters (Hu et al. 2022) injected into a model with ``peft``: the model side of
FedLoRA (:mod:`splitfed.algorithms.fedlora`), also used by the client-memory probe
(``benchmarks/client_memory.py``)."""

from __future__ import annotations

from torch import nn

from splitfed.configtools import check_bounds, show
from splitfed.errors import ConfigError

#: the bounds of the adapters' values, by their keys in FedLoRA's options
#: (``algorithm.<key>``; :class:`splitfed.algorithms.fedlora.FedLoRAOptions` declares them)
BOUNDS = {"rank": {"ge": 1, "le": 10**4}, "alpha": {"gt": 0},
          "lora_dropout": {"ge": 0, "lt": 1}}


def default_targets(model: nn.Module) -> list[str]:
    """q_proj and v_proj (attention, as the LoRA paper) if the model has them, else the
    names of every linear layer outside the head (the last block)."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    attention = sorted({n.rsplit(".", 1)[-1] for n in names} & {"q_proj", "v_proj"})
    if attention:
        return attention
    head = _head(model)
    if head is None:                      # one block: it is the head
        return []
    return [n for n in names if n != head and not n.startswith(head + ".")]


def _head(model: nn.Module) -> str | None:
    """The name of the model's last block (its classification head); None for a model
    without blocks."""
    children = [n for n, _ in model.named_children()]
    return children[-1] if children else None


def add_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
             targets=None, train_head: bool = True) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place and freeze everything else (the
    head excepted when ``train_head``). Idempotent: a model with adapters is returned as is.

    ``rank``, ``alpha`` and ``dropout`` outside FedLoRA's bounds (:data:`BOUNDS`) and
    ``targets`` that are not a list of names raise :class:`ConfigError` naming the
    option (``algorithm.rank``, ``algorithm.alpha``, ``algorithm.lora_dropout``,
    ``algorithm.targets``) before peft sees them; what peft then refuses concerns the
    targets (``algorithm.targets``)."""
    if getattr(model, "lora_injected", False):
        return model
    _check_values(rank, alpha, dropout, targets)
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ConfigError("fedlora needs the 'peft' package: pip install -e '.[llm]'") from e
    targets = default_targets(model) if targets is None else list(targets)
    try:
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                            target_modules=targets, bias="none")
        inject_adapter_in_model(config, model)
    except Exception as e:  # peft's NoMatchingPeftModuleError and ValueError
        raise ConfigError(f"algorithm.targets: {e}") from e
    head = _head(model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name or (train_head and head is not None
                                             and name.startswith(head + ".")))
    model.lora_injected = True
    return model


def _check_values(rank, alpha, dropout, targets) -> None:
    """The values :func:`add_lora` gives peft, checked as a config checks FedLoRA's
    options: each error names its option."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ConfigError(f"algorithm.rank: expected an integer, got {show(rank)}")
    for key, value in (("rank", rank), ("alpha", alpha), ("lora_dropout", dropout)):
        check_bounds(value, f"algorithm.{key}", BOUNDS[key])
    if targets is not None and (isinstance(targets, str) or not isinstance(targets, (list, tuple))
                                or not all(isinstance(t, str) for t in targets)):
        raise ConfigError(f"algorithm.targets: expected a list of module names (or null), "
                          f"got {show(targets)}")


def trainable_keys(model: nn.Module) -> list[str]:
    return [k for k, p in model.named_parameters() if p.requires_grad]
