"""FedLoRA: FedAvg over LoRA adapters (Hu et al. 2022), paper 001 Fig. 4's baseline.

At round 0, LoRA adapters (``peft``; rank r, scaling alpha / r, A random, B zero, so
the model is unchanged) are injected into the ``targets`` linear layers of the model
(default: OPT's attention ``q_proj`` and ``v_proj``, as the LoRA paper; in a model
without them every linear layer outside the head); every other parameter is frozen,
except the classification head (the model's last block; ``train_head``, default true: a
classifier for a new task has a fresh head). Each round is FedAvg on the trainable part
only: the clients receive the adapters and the head, run local SGD on them with the base
weights fixed, and upload them; the server averages them with eta_g. The frozen base is
sent to nobody after round 0 (the clients hold it from the start; it is not counted).

Options: ``rank`` (8), ``alpha`` (16), ``lora_dropout`` (0), ``targets`` (module-name
suffixes, checked against the model's linear layers before the run starts:
:meth:`FedLoRA.check`), ``train_head``, ``global_lr`` (eta_g). Adapters draw from a
run-seed stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from splitfed.algorithms.fedavg import FedAvg
from splitfed.errors import ConfigError
from splitfed.models.lora import BOUNDS, add_lora, default_targets, trainable_keys
from splitfed.rng import derive_seed


@dataclass
class FedLoRAOptions:
    global_lr: float = field(default=1.0, metadata={"gt": 0, "help": "eta_g"})
    rank: int = field(default=8, metadata={**BOUNDS["rank"], "help": "LoRA rank r"})
    alpha: float = field(default=16.0, metadata={**BOUNDS["alpha"],
                                                 "help": "LoRA scaling alpha / r"})
    lora_dropout: float = field(default=0.0, metadata={
        **BOUNDS["lora_dropout"],
        "help": "dropout probability on the adapters' input (peft's lora_dropout; 0: none)"})
    targets: list[str] | None = field(default=None, metadata={
        "help": "names (suffixes) of the linear layers that get adapters (null: q_proj "
                "and v_proj if the model has them, else every linear layer but the head)"})
    train_head: bool = field(default=True, metadata={
        "help": "also train (and communicate) the classification head"})


class FedLoRA(FedAvg):
    name = "fedlora"
    reference = "FedAvg (McMahan et al. 2017) over LoRA adapters (Hu et al. 2022); paper 001 Fig. 4"
    Options = FedLoRAOptions
    distributed = False                   # not on the multi-process runtime yet
    trains_whole_model = False            # the clients train the adapters and the head
    #: most linear layers an error lists by their full names
    LISTED = 12

    def check(self, env) -> None:
        """``targets`` name linear layers of the model: each target, a module's name or
        the end of it after a dot (peft's matching), matches at least one module, and
        every module it matches is a linear layer (a block would fail in peft once the
        run directory exists); with the default (null), the model has a linear layer
        outside its head to adapt."""
        targets = self.options.targets
        linear = [n for n, m in env.model.named_modules() if isinstance(m, nn.Linear)]
        if len(linear) > self.LISTED:       # a deep model: the distinct ends of the names
            linear = sorted({n.rsplit(".", 1)[-1] for n in linear})
        valid = f"the linear layers of model {env.config.model.name!r}: {', '.join(linear)}"
        if targets is None:
            if not default_targets(env.model):
                raise ConfigError(
                    f"algorithm.targets: null (the default) finds no linear layer outside "
                    f"the head of model {env.config.model.name!r} to adapt; give a model "
                    f"with a hidden linear layer, or names of {valid}"
                    if linear else
                    f"algorithm.targets: model {env.config.model.name!r} has no linear "
                    "layer to adapt; LoRA adapts linear layers")
            return
        if not targets:
            raise ConfigError(f"algorithm.targets: empty; give names of {valid} (or null: "
                              "the default)")
        for target in targets:
            matched = [(n, m) for n, m in env.model.named_modules()
                       if n and (n == target or n.endswith(f".{target}"))]
            wrong = [n for n, m in matched if not isinstance(m, nn.Linear)]
            if not matched or wrong:
                what = (f"matches {', '.join(wrong)}, not a linear layer" if wrong
                        else "matches no module")
                raise ConfigError(f"algorithm.targets: {target!r} {what}; give names (or "
                                  f"their ends after a dot) of {valid}")

    def prepare_model(self, env) -> None:
        """Inject the adapters into ``env.model`` (their initial values drawn from the
        run's seed, stream ``lora``) and freeze the rest but the head."""
        o = self.options
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(env.streams.seed, "lora"))
            add_lora(env.model, o.rank, o.alpha, o.lora_dropout, o.targets, o.train_head)

    def init_state(self, env) -> dict:
        self.prepare_model(env)
        return super().init_state(env)

    def communicated(self, env, state: dict) -> dict:
        return {k: state["model"][k] for k in trainable_keys(env.model)}
