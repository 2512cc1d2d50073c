"""Decoder-only transformer classifiers (Hugging Face ``transformers``) split at block Lc.

Paper 001 Sec. 5 and Appendix E fine-tune OPT-1.3B (24 decoder blocks) on SST-2 and split
it after decoder block Lc. Here a Hugging Face sequence-classification model (OPT:
``OPTForSequenceClassification``) is taken apart into a :class:`BlockModel`:

    block1 = token and position embeddings + decoder block 1
    block2 .. blockN = decoder blocks 2 .. N
    head = final layer norm (and projection) + classification layer (``score``)

so a cut ``k`` (1..N) puts the embeddings and the first ``k`` decoder blocks on the client
and the remaining blocks and the head on the server, as the paper's Lc. The blocks *are*
the Hugging Face modules (no copies): ``from_hf(model)`` of a loaded model gives the same
logits as the model's own forward (tested).

Inputs are one integer tensor per sample, ``[2, L]``: row 0 the token ids, row 1 the
attention mask (1 = token, 0 = right padding; :mod:`splitfed.data.text` makes them). The
activation between blocks is ``[B, L, H + 1]``: the hidden states with the attention mask
as one extra channel, so the mask crosses the cut with the smashed data (the server needs
it; it is counted in the bytes up, 1 / (H + 1) of the payload). The head pools the
rightmost unpadded position, as ``OPTForSequenceClassification`` does.

Weights: from a local ``save_pretrained`` directory (``pretrained=<dir>``; nothing is ever
downloaded), else random initialisation from a config: a named ``preset``
(``tiny``, ``opt-125m``, ``opt-350m``, ``opt-1.3b``) with any of its sizes overridden.
Dropout is 0 by default (``dropout``): zeroth-order methods compare two forward passes of
the same batch, which random dropout masks would decorrelate (as MeZO does).

The cohort forward (:mod:`splitfed.models.cohort`) runs these blocks client by client
(``cohort_per_client``): their matrix products already fill the machine, and Hugging Face
layers are not written for stacked parameters.

Adding another decoder-only family: a :class:`Family` entry that names its embedding
module (ids and mask -> hidden states), its decoder layers and its head parts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from splitfed.data.text import FIRST_WORD
from splitfed.errors import ConfigError, describe
from splitfed.limits import MAX_MODEL_PARAMS
from splitfed.models.blocks import BlockModel, check_dropout

# OPT sizes (Zhang et al. 2022, Table 1; the Hugging Face configs)
PRESETS = {
    "tiny": dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, ffn_dim=64,
                 vocab_size=8192, word_embed_proj_dim=None, do_layer_norm_before=True),
    "opt-125m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                     ffn_dim=3072, vocab_size=50272, word_embed_proj_dim=None,
                     do_layer_norm_before=True, max_position_embeddings=2048),
    "opt-350m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                     ffn_dim=4096, vocab_size=50272, word_embed_proj_dim=512,
                     do_layer_norm_before=False, max_position_embeddings=2048),
    "opt-1.3b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                     ffn_dim=8192, vocab_size=50272, word_embed_proj_dim=None,
                     do_layer_norm_before=True, max_position_embeddings=2048),
}
#: token ids every vocabulary holds (:mod:`splitfed.data.text`: <s>, PAD, BOS/EOS, UNK)
RESERVED_IDS = FIRST_WORD
#: decoder blocks of a model built from sizes (each is a Python object built in turn)
MAX_LAYERS = 1024
#: the Hugging Face attention kernels a model may ask for
ATTENTION = ("sdpa", "eager")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ConfigError("transformer models need the 'transformers' package: "
                          "pip install -e '.[llm]'") from e
    return transformers


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask [B, 1, L, L]: 0 where query i may attend to key j (j <= i
    and key j is a token), the dtype's minimum elsewhere."""
    b, length = mask.shape
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    allowed = causal.unsqueeze(0) & (mask > 0).unsqueeze(1)
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=mask.device)
    return torch.where(allowed, zero, low).unsqueeze(1)


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """Index of the rightmost position with mask 1 in each row (0 for an empty row)."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return (positions * (mask > 0)).argmax(-1)


def _with_mask(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.cat([h, mask.unsqueeze(-1).to(h.dtype)], dim=-1)


class OPTEmbedding(nn.Module):
    """Token ids and mask ``[B, 2, L]`` -> hidden states and mask ``[B, L, H + 1]``
    (OPT: token embedding, optional projection in, learned positions from the mask)."""

    cohort_per_client = True

    def __init__(self, tokens: nn.Embedding, positions: nn.Module, project_in: nn.Module | None):
        super().__init__()
        self.tokens, self.positions, self.project_in = tokens, positions, project_in

    def check_token_ids(self, x: torch.Tensor) -> None:
        """ConfigError when a token id of ``x`` ([N, 2, L]) is outside the vocabulary
        (checked on the whole data set before a run, and on every batch)."""
        ids = x[:, 0]
        if ids.numel() and int(ids.max()) >= self.tokens.num_embeddings:
            raise ConfigError(f"model.vocab_size: the data hold token id {int(ids.max())}, "
                              f"beyond the model's vocab_size {self.tokens.num_embeddings}; "
                              "use a tokenizer matching the model, or set model.vocab_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_token_ids(x)
        ids, mask = x[:, 0].long(), x[:, 1].long()
        h = self.tokens(ids)
        if self.project_in is not None:
            h = self.project_in(h)
        h = h + self.positions(mask, 0)
        return _with_mask(h, mask)


class DecoderBlock(nn.Module):
    """One Hugging Face decoder layer on ``[B, L, H + 1]`` (hidden states and mask)."""

    cohort_per_client = True

    def __init__(self, layer: nn.Module, embedding: nn.Module | None = None):
        super().__init__()
        if embedding is not None:
            self.embed = embedding
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "embed"):
            x = self.embed(x)
        h, mask = x[..., :-1], x[..., -1]
        out = self.layer(h, attention_mask=attention_bias(mask, h.dtype))
        if isinstance(out, tuple):
            out = out[0]
        return _with_mask(out, mask)


class ClassifierHead(nn.Module):
    """``[B, L, H + 1]`` -> logits ``[B, K]`` at the rightmost token: final norm,
    projection out (if any), classification layer."""

    cohort_per_client = True

    def __init__(self, norm: nn.Module | None, project_out: nn.Module | None, score: nn.Linear):
        super().__init__()
        self.norm, self.project_out, self.score = norm, project_out, score

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, mask = x[..., :-1], x[..., -1]
        h = h[torch.arange(h.shape[0], device=h.device), last_token(mask)]
        if self.norm is not None:
            h = self.norm(h)
        if self.project_out is not None:
            h = self.project_out(h)
        return self.score(h)


@dataclass
class Family:
    """How to take a Hugging Face sequence classifier of one family apart."""

    embedding: Callable[[nn.Module], nn.Module]
    layers: Callable[[nn.Module], list[nn.Module]]
    head: Callable[[nn.Module], nn.Module]


def _opt_decoder(m):
    return m.model.decoder


FAMILIES: dict[str, Family] = {
    "opt": Family(
        embedding=lambda m: OPTEmbedding(_opt_decoder(m).embed_tokens,
                                         _opt_decoder(m).embed_positions,
                                         _opt_decoder(m).project_in),
        layers=lambda m: list(_opt_decoder(m).layers),
        head=lambda m: ClassifierHead(_opt_decoder(m).final_layer_norm,
                                      _opt_decoder(m).project_out, m.score)),
}


def from_hf(hf_model: nn.Module, name: str | None = None) -> BlockModel:
    """The :class:`BlockModel` over ``hf_model``'s own modules (shared, not copied)."""
    family = FAMILIES.get(hf_model.config.model_type)
    if family is None:
        raise ConfigError(f"model type {hf_model.config.model_type!r} is not supported; "
                          f"supported: {', '.join(sorted(FAMILIES))}")
    layers = family.layers(hf_model)
    blocks = OrderedDict()
    for i, layer in enumerate(layers, start=1):
        blocks[f"block{i}"] = DecoderBlock(layer, family.embedding(hf_model) if i == 1 else None)
    blocks["head"] = family.head(hf_model)
    n = len(layers)
    cuts = {k: f"embeddings + decoder blocks 1..{k} on the client" for k in range(1, n + 1)}
    model = BlockModel(blocks, name=name or hf_model.config.model_type, cut_descriptions=cuts,
                       default_cut=min(2, n))
    model.hf_config = hf_model.config
    model.__dict__["hf_model"] = hf_model     # not a submodule: its modules are the blocks
    return model


def save_pretrained(model: BlockModel, directory: str | Path) -> None:
    """Save a model built by :func:`from_hf` (its current weights) as a Hugging Face
    ``save_pretrained`` directory, loadable with ``pretrained=<directory>``."""
    model.hf_model.save_pretrained(directory)


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


#: the options of :func:`opt` that set a size of the model, by OPTConfig's names
SIZE_OPTIONS = {"hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
                "num_attention_heads": "num_heads", "ffn_dim": "ffn_dim",
                "vocab_size": "vocab_size", "max_position_embeddings": "max_positions"}


def opt_config(num_classes: int, seq_len: int, *, preset: str = "tiny", **sizes):
    """An ``OPTConfig`` for ``preset`` with ``sizes`` (OPTConfig's names; None: the
    preset's) overridden, for sequences of ``seq_len`` tokens. Sizes that OPT cannot
    take, and models over :data:`~splitfed.limits.MAX_MODEL_PARAMS` parameters, raise
    :class:`ConfigError` naming the option, before anything is built."""
    if preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {preset!r}; presets: "
                          f"{', '.join(PRESETS)}")
    values = dict(PRESETS[preset])
    values.setdefault("max_position_embeddings", seq_len)
    for key, v in sizes.items():
        if v is None:
            continue
        if key in SIZE_OPTIONS and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"model.{SIZE_OPTIONS[key]}: must be a positive integer, "
                              f"got {v!r}")
        values[key] = v
    if values["word_embed_proj_dim"] is None:
        values["word_embed_proj_dim"] = values["hidden_size"]
    h, heads = values["hidden_size"], values["num_attention_heads"]
    if h % heads:
        raise ConfigError(f"model.hidden_size: {h} is not a multiple of model.num_heads "
                          f"({heads}); each attention head takes hidden_size / num_heads")
    if values["vocab_size"] < RESERVED_IDS:
        raise ConfigError(f"model.vocab_size: must be at least {RESERVED_IDS} (ids 0-"
                          f"{RESERVED_IDS - 1} are reserved: <s>, padding, BOS/EOS, unknown), "
                          f"got {values['vocab_size']}")
    broken = _size_limit_broken(values, num_classes, seq_len)
    if broken:
        option, what = broken
        hint = {"num_layers": "", "max_positions": f"; give at least {seq_len}"}.get(
            option, "; choose smaller sizes")
        raise ConfigError(f"model{'.' + option if option else ''}: opt would have {what}{hint}")
    cfg = _transformers().OPTConfig(num_labels=num_classes, pad_token_id=1,
                                    bos_token_id=2, eos_token_id=2, **values)
    return cfg


def opt_params(values: dict, num_classes: int) -> int:
    """Parameters of an OPT classifier of OPTConfig ``values`` (without building it):
    token and position embeddings, the projections when ``word_embed_proj_dim`` differs,
    per decoder layer attention (4 h x h + biases), the feed-forward pair and two layer
    norms, the final layer norm (pre-norm models only) and the classification layer."""
    h, f = values["hidden_size"], values["ffn_dim"]
    p = values["word_embed_proj_dim"] or h
    n = values["vocab_size"] * p + (values["max_position_embeddings"] + 2) * h
    n += 2 * h * p if p != h else 0
    n += values["num_hidden_layers"] * (4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h)
    n += 2 * h if values.get("do_layer_norm_before", True) else 0  # the final layer norm
    return n + p * num_classes


@contextmanager
def _quiet_loading(tf):
    """transformers' own progress bars ("Loading weights") off while a local checkpoint
    loads, then as they were: a run shows its progress itself (``progress``)."""
    logging = tf.utils.logging
    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


def _check_pretrained_size(tf, path: Path, num_classes: int, seq_len: int) -> None:
    """The model a ``save_pretrained`` directory describes is an OPT of at most
    :data:`~splitfed.limits.MAX_MODEL_PARAMS` parameters, counted from its config.json
    before anything is built (loading fills every weight the directory lacks, so a
    config declaring billions of parameters would be allocated in full)."""
    try:
        conf = tf.AutoConfig.from_pretrained(path, local_files_only=True,
                                             trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot read
        raise ConfigError(f"model.pretrained: cannot read {path / 'config.json'}: "
                          f"{describe(e, 200)}") from None
    if getattr(conf, "model_type", None) != "opt":
        raise ConfigError(f"model.pretrained: {path} holds a {getattr(conf, 'model_type', None)!r} "
                          "model; model.name=opt loads OPT models only")
    values = {k: getattr(conf, k, None) for k in (
        "hidden_size", "ffn_dim", "word_embed_proj_dim", "vocab_size",
        "max_position_embeddings", "num_hidden_layers", "do_layer_norm_before")}
    if not all(isinstance(values[k], int) and not isinstance(values[k], bool) and values[k] > 0
               for k in ("hidden_size", "ffn_dim", "vocab_size", "max_position_embeddings",
                         "num_hidden_layers")):
        raise ConfigError(f"model.pretrained: {path / 'config.json'} gives sizes that are not "
                          f"positive integers: { {k: v for k, v in values.items()} }")
    broken = _size_limit_broken(values, num_classes, seq_len)
    if broken:
        option, what = broken
        hint = ("; lower the data's max_len (sst2) or seq_len (synthetic_text)"
                if option == "max_positions" else "")
        raise ConfigError(f"model.pretrained: the OPT in {path} has {what}{hint}")


def _size_limit_broken(values: dict, num_classes: int, seq_len: int) -> tuple[str, str] | None:
    """The first of splitfed's size limits the OPTConfig ``values`` break, as (the model
    option it concerns, "" for the whole size; what is wrong), or None when none is."""
    layers, positions = values["num_hidden_layers"], values["max_position_embeddings"]
    if layers > MAX_LAYERS:
        return "num_layers", (f"{layers} decoder blocks, more than the {MAX_LAYERS} allowed "
                              "(OPT-175B has 96)")
    if positions < seq_len:
        return "max_positions", (f"{positions} positions, fewer than the data's sequences "
                                 f"of {seq_len} tokens")
    params = opt_params(values, num_classes)
    if params > MAX_MODEL_PARAMS:
        return "", f"about {params} parameters, more than the {MAX_MODEL_PARAMS} allowed"
    return None


def _check_shape(input_shape) -> int:
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 2 or shape[0] != 2 or shape[1] < 1:
        raise ConfigError(f"model.name: transformer classifiers take token ids and an "
                          f"attention mask, input_shape (2, L); data.name gives samples of "
                          f"shape {shape}")
    return shape[1]


def opt(input_shape, num_classes: int, *, preset: str | None = None,
        pretrained: str | None = None,
        hidden_size: int | None = None, num_layers: int | None = None,
        num_heads: int | None = None, ffn_dim: int | None = None,
        vocab_size: int | None = None, max_positions: int | None = None,
        dropout: float = 0.0, dtype: str = "float32", attention: str = "sdpa") -> BlockModel:
    """OPT sequence classifier split into embeddings + decoder blocks + head (see module).

    ``preset``: the sizes, ``tiny`` when None; the size options override them.
    ``pretrained``: a local ``save_pretrained`` directory, whose config.json gives the
    sizes (a preset or size option beside it is refused; the classification layer is new
    if the checkpoint has none). ``dtype``: float32, bfloat16, float16. ``attention``:
    the Hugging Face attention kernel (sdpa, eager).
    """
    seq_len = _check_shape(input_shape)
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if attention not in ATTENTION:
        raise ConfigError(f"model.attention: must be one of {', '.join(ATTENTION)}, got "
                          f"{attention!r}")
    check_dropout(dropout)
    tf = _transformers()
    extra = dict(dropout=dropout, attention_dropout=dropout, layerdrop=0.0)
    if pretrained is not None:
        sizes = {"preset": preset, "hidden_size": hidden_size, "num_layers": num_layers,
                 "num_heads": num_heads, "ffn_dim": ffn_dim, "vocab_size": vocab_size,
                 "max_positions": max_positions}
        given = [k for k, v in sizes.items() if v is not None]
        if given:
            raise ConfigError(f"model.{given[0]}: a pretrained model's sizes come from the "
                              f"config.json in model.pretrained; remove model.{given[0]} "
                              "(or model.pretrained)")
        path = Path(pretrained)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.pretrained: {path} is not a save_pretrained directory "
                              "(no config.json); models are never downloaded")
        _check_pretrained_size(tf, path, num_classes, seq_len)
        try:
            with _quiet_loading(tf):
                hf, info = tf.AutoModelForSequenceClassification.from_pretrained(
                    path, num_labels=num_classes, local_files_only=True,
                    trust_remote_code=False, dtype=DTYPES[dtype],
                    attn_implementation=attention, output_loading_info=True, **extra)
        except Exception as e:  # noqa: BLE001 - weights transformers or torch cannot read
            if "ignore_mismatched_sizes" in str(e):
                raise ConfigError(f"model.pretrained: the classification layer in {path} "
                                  f"has another number of classes than the data's "
                                  f"{num_classes}; use a checkpoint without a classification "
                                  "head (score), or one made for this data") from None
            if type(e).__name__ == "UnpicklingError":
                raise ConfigError(f"model.pretrained: the weights in {path} are a pickle "
                                  "that holds more than tensors; refused (loading it could "
                                  "run code): save them as safetensors") from None
            raise ConfigError(f"model.pretrained: cannot load {path}: {describe(e)}") from None
        missing = [k for k in info.get("missing_keys", ()) if not k.startswith("score.")]
        if missing:
            raise ConfigError(f"model.pretrained: {path} lacks {len(missing)} weights of its "
                              f"model (e.g. {sorted(missing)[0]}); only the classification "
                              "layer (score) may be new")
    else:
        cfg = opt_config(num_classes, seq_len, preset="tiny" if preset is None else preset,
                         hidden_size=hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, ffn_dim=ffn_dim,
                         vocab_size=vocab_size, max_position_embeddings=max_positions,
                         **extra)
        cfg._attn_implementation = attention
        with _default_dtype(DTYPES[dtype]):
            hf = tf.OPTForSequenceClassification(cfg)
    hf.train()
    return from_hf(hf, name="opt")


#: the options' help (``splitfed config explain opt``, docs/config.md)
opt.option_help = {
    "preset": "the sizes: tiny, opt-125m, opt-350m or opt-1.3b (Zhang et al. 2022; null: "
              "tiny); the size options override them",
    "pretrained": "a local save_pretrained directory whose weights and config.json sizes "
                  "are loaded (never downloaded; not with preset or a size option)",
    "hidden_size": "H, the hidden size: an integer >= 1, a multiple of num_heads (null: "
                   "the preset's)",
    "num_layers": "decoder blocks: an integer from 1 to 1024 (null: the preset's)",
    "num_heads": "attention heads: an integer >= 1 that divides hidden_size (null: the "
                 "preset's)",
    "ffn_dim": "width of every block's feed-forward layer: an integer >= 1 (null: the "
               "preset's)",
    "vocab_size": "token embeddings: an integer >= 4, ids 0-3 being reserved (null: the "
                  "preset's)",
    "max_positions": "position embeddings: at least the data's sequence length (null: the "
                     "preset's, or that length for tiny)",
    "dropout": "dropout and attention-dropout probability (0 <= dropout < 1; 0: two "
               "forward passes of a batch agree, as ZO methods need)",
    "dtype": "the parameters' dtype: float32, bfloat16, float16 or float64",
    "attention": "the Hugging Face attention kernel: sdpa or eager",
}
