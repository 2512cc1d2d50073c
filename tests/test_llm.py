"""Split transformer classifiers, text data, FedLoRA and client-memory measurement."""

import copy

import numpy as np
import pytest
import torch
from helpers import assert_float_close, digits_config

pytest.importorskip("transformers")

from splitfed.config import build_config  # noqa: E402
from splitfed.data import load_dataset  # noqa: E402
from splitfed.data.text import BOS, PAD, UNK  # noqa: E402
from splitfed.experiment import build_algorithm, build_environment, run_experiment  # noqa: E402
from splitfed.models import build_model, split  # noqa: E402
from splitfed.models.cohort import cohort_forward, stack_states  # noqa: E402
from splitfed.models.transformer import from_hf, opt_config  # noqa: E402
# the client-memory probe lives in benchmarks/ (importable under python -m pytest)
from benchmarks.client_memory import run_fresh  # noqa: E402

TINY = {"name": "opt", "hidden_size": 16, "num_layers": 3, "num_heads": 2, "ffn_dim": 32,
        "vocab_size": 40}


def batch(n=5, length=12, vocab=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    for i, k in enumerate([length, 7, 3, 1, 10][:n]):
        mask[i, k:] = 0
    ids[mask == 0] = PAD
    return ids, mask


def hf_tiny(layers=3):
    import transformers
    torch.manual_seed(0)
    cfg = opt_config(2, 12, preset="tiny", hidden_size=16, num_hidden_layers=layers,
                     num_attention_heads=2, ffn_dim=32, vocab_size=40)
    return transformers.OPTForSequenceClassification(cfg).eval()


def hf_logits(hf, ids, mask):
    """``hf``'s logits in float32 and, from a float64 copy, in float64 (the bound of
    :func:`helpers.assert_float_close`; the largest reduction is the FFN's 32 inputs)."""
    hf64 = copy.deepcopy(hf).double()
    return (hf(input_ids=ids, attention_mask=mask).logits,
            hf64(input_ids=ids, attention_mask=mask).logits)


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_client_then_server_equals_the_unsplit_model(cut):
    hf = hf_tiny()
    model = from_hf(hf)
    ids, mask = batch()
    want32, want64 = hf_logits(hf, ids, mask)
    client, server = split(model, cut)
    got = server(client(torch.stack([ids, mask], 1)))
    assert_float_close(got, want32, want64, terms=32, what=f"cut {cut}")
    assert model.valid_cuts == [1, 2, 3]
    keys = set(client.state_dict()) | set(server.state_dict())
    assert len(keys) == len(model.state_dict())


def test_pretrained_from_a_local_directory(tmp_path, capfd):
    import transformers

    hf = hf_tiny(layers=2)
    hf.save_pretrained(tmp_path)
    capfd.readouterr()
    model = build_model("opt", (2, 12), 2, pretrained=str(tmp_path))
    # transformers' "Loading weights" bar stays off (a run shows its own progress) and
    # its setting is restored
    assert "Loading weights" not in "".join(capfd.readouterr())
    assert transformers.utils.logging.is_progress_bar_enabled()
    ids, mask = batch()
    model.eval()
    got = model(torch.stack([ids, mask], 1))
    assert_float_close(got, *hf_logits(hf, ids, mask), terms=32)


def test_a_pretrained_directory_is_sized_before_it_is_built(tmp_path):
    # its config.json declares ~2.4e9 parameters and its weights file lacks them: loading
    # would allocate and fill them all; the declared size is refused first
    import json

    from splitfed.errors import ConfigError

    hf = hf_tiny(layers=2)
    hf.save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf.update(hidden_size=2048, ffn_dim=8192, num_hidden_layers=48, num_attention_heads=16,
                word_embed_proj_dim=2048)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match=r"^model.pretrained: the OPT in .* has about "
                                          r"2\d{9} parameters, more than the 2000000000"):
        build_model("opt", (2, 12), 2, pretrained=str(tmp_path))
    conf["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match=r"holds a 'gpt2' model; model.name=opt loads OPT"):
        build_model("opt", (2, 12), 2, pretrained=str(tmp_path))


class _NotATensor:
    pass


def test_pretrained_directories_that_cannot_serve_are_refused_before_the_run(tmp_path):
    import json
    import shutil

    from splitfed.errors import ConfigError

    hf_tiny(layers=2).save_pretrained(tmp_path / "ok")

    def variant(name):
        shutil.copytree(tmp_path / "ok", tmp_path / name)
        return tmp_path / name

    short = variant("short")                 # fewer positions than the data's tokens
    conf = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 8}))
    with pytest.raises(ConfigError, match=r"has 8 positions, fewer than the data's "
                                          r"sequences of 12 tokens"):
        build_model("opt", (2, 12), 2, pretrained=str(short))
    partial = variant("partial")             # weights for 2 blocks, config for 3
    conf = json.loads((partial / "config.json").read_text())
    (partial / "config.json").write_text(json.dumps({**conf, "num_hidden_layers": 3}))
    with pytest.raises(ConfigError, match=r"lacks \d+ weights of its model \(e.g. "
                                          r"model.decoder.layers.2.*only the classification"):
        build_model("opt", (2, 12), 2, pretrained=str(partial))
    with pytest.raises(ConfigError, match=r"the classification layer in .* has another "
                                          r"number of classes than the data's 3"):
        build_model("opt", (2, 12), 3, pretrained=str(tmp_path / "ok"))
    pickled = variant("pickled")             # a weights file that is not plain tensors
    (pickled / "model.safetensors").unlink()
    torch.save({"x": _NotATensor()}, pickled / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"a pickle that holds more than tensors; refused"):
        build_model("opt", (2, 12), 2, pretrained=str(pickled))
    with pytest.raises(ConfigError, match=r"^model.attention: must be one of sdpa, eager"):
        build_model("opt", (2, 12), 2, attention="flash")


def test_cohort_forward_runs_each_client_with_its_own_parameters():
    model = build_model("opt", (2, 12), 2, **{k: v for k, v in TINY.items() if k != "name"})
    other = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    ids, mask = batch()
    x = torch.stack([ids, mask], 1)
    out = cohort_forward(model, stack_states([model.state_dict(), other]),
                         torch.stack([x, x]), training=False)
    model.eval()
    for c, state in enumerate([model.state_dict(), other]):
        model.load_state_dict(state)
        model64 = copy.deepcopy(model).double()     # token ids stay integers
        assert_float_close(out[c], model(x), model64(x), terms=32, what=f"client {c}")



def test_cohort_forward_of_a_transformer_follows_the_training_flag():
    """With dropout, a cohort pass with training=False is the eval-mode forward of each
    client (no dropout, whatever mode the template is in, which is left as it was), and
    with training=True it draws dropout masks."""
    model = build_model("opt", (2, 12), 2, dropout=0.5,
                        **{k: v for k, v in TINY.items() if k != "name"})
    ids, mask = batch()
    x = torch.stack([ids, mask], 1)
    state = stack_states([model.state_dict()] * 2)
    model.train()
    out = cohort_forward(model, state, torch.stack([x, x]), training=False)
    assert model.training
    with torch.no_grad():
        want, want64 = model.eval()(x), copy.deepcopy(model).double()(x)
    for c in range(2):
        assert_float_close(out[c], want, want64, terms=32, what=f"client {c}")
    out = cohort_forward(model, state, torch.stack([x, x]), training=True)
    assert not model.training
    assert not torch.allclose(out[0], out[1])

def text_config(algorithm, **over):
    raw = {"name": "t", "rounds": 2, "progress": False, "seed": 1,
           "algorithm": algorithm,
           "data": {"name": "synthetic_text", "num_train": 64, "num_test": 32,
                    "seq_len": 10, "vocab_size": 40},
           "partition": {"scheme": "iid", "num_clients": 2},
           "model": {**TINY, "cut": 1},
           "train": {"batch_size": 8, "local_steps": 2, "local_epochs": None, "lr": 0.05},
           "participation": {"mode": "full"}}
    raw.update(over)
    return build_config(raw)


@pytest.mark.parametrize("algorithm", [{"name": "fedavg"}, {"name": "fedlora", "rank": 2},
                                       {"name": "musplitfed", "tau": 3}])
def test_algorithms_run_on_the_split_transformer(algorithm):
    res = run_experiment(text_config(algorithm), write=False)
    assert res.status == "completed"
    assert all(np.isfinite(r["train_loss"]) for r in res.records[1:])


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
@pytest.mark.parametrize("aux", ["linear", "mlp"])
def test_csefsl_trains_its_head_in_the_models_dtype(dtype, aux):
    res = run_experiment(text_config({"name": "csefsl", "aux": aux},
                                     model={**TINY, "cut": 1, "dtype": dtype}), write=False)
    assert res.status == "completed"
    assert all(np.isfinite(r["train_loss"]) for r in res.records[1:])
    assert {str(v.dtype) for v in res.state["aux"].values()} == {f"torch.{dtype}"}


def test_token_ids_beyond_the_vocabulary_anywhere_in_the_data_are_refused_first():
    from splitfed.errors import ConfigError

    cfg = text_config({"name": "fedavg"})
    env = build_environment(cfg)
    top = int(env.data.train.x[:, 0].max())
    assert top == 39 and int(env.data.test.x[:1, 0].max()) < top   # not in the probe
    small = text_config({"name": "fedavg"}, model={**TINY, "vocab_size": top, "cut": 1})
    with pytest.raises(ConfigError, match=r"^model.vocab_size: the data hold token id 39, "
                                          r"beyond the model's vocab_size 39"):
        build_environment(small)


def test_mu_split_is_musplitfed_with_one_client():
    cfg = text_config({"name": "musplitfed", "tau": 2},
                      partition={"scheme": "iid", "num_clients": 1})
    res = run_experiment(cfg, write=False)
    assert res.records[-1]["participants"] == 1


def test_zo_client_update_leaves_the_server_copy_untouched():
    from splitfed.engine.split import SplitModel
    from splitfed.engine.stacked import ForwardCopies

    cfg = text_config({"name": "musplitfed"})
    env = build_environment(cfg)
    algo = build_algorithm(cfg)
    state = algo.init_state(env)
    env.ledger.round = 1
    parts = SplitModel.of(env)
    ids = np.array([0, 1])
    x = env.data.train.x[torch.arange(16).view(2, 8)]
    y = env.data.train.y[torch.arange(16).view(2, 8)]
    client = ForwardCopies(parts.client, parts.client_state(state["model"]), 2,
                           clock=env.clock, role="client", ids=ids)
    server = ForwardCopies(parts.server, parts.server_state(state["model"]), 2,
                           clock=env.clock, role="server_copy", ids=ids)
    server_before = {k: v.clone() for k, v in server.state.items()}
    client_before = [p.clone() for p in client.params()]
    seeds = algo._seeds(7, "client", 0)
    with torch.no_grad():
        from splitfed.engine import zo
        u = zo.directions(seeds[0], client.params())
        sent = [client.forward(x)] + [client.forward(x, zo.perturb(client.params(), u, s * 0.005))
                                      for s in (1, -1)]
        algo._client_step(env, client, server, sent, y, ids, seeds, [], x, 0.01)
    assert all(torch.equal(server.state[k], v) for k, v in server_before.items())
    assert not all(torch.equal(a, b) for a, b in zip(client.params(), client_before))
    shared = parts.server_state(state["model"])          # the global server model, too
    assert all(torch.equal(shared[k], server_before[k][0]) for k in shared)


def test_fedlora_trains_and_sends_only_adapters_and_head():
    cfg = text_config({"name": "fedlora", "rank": 2})
    env = build_environment(cfg)
    algo = build_algorithm(cfg)
    start = algo.init_state(env)["model"]
    res = run_experiment(cfg, write=False)
    end = res.state["model"]
    assert set(end) == set(start)
    trained = [k for k in start if not torch.equal(start[k], end[k])]
    assert trained and all("lora_" in k or k.startswith("head.") for k in trained)
    assert any("lora_B" in k for k in trained)
    assert all(torch.equal(start[k], end[k]) for k in start
               if "lora_" not in k and not k.startswith("head."))
    sent = sum(v.numel() * v.element_size() for k, v in start.items()
               if "lora_" in k or k.startswith("head."))
    assert res.records[-1]["bytes_down/model"] == 2 * sent
    assert res.records[-1]["bytes_up/model"] == 2 * sent


def test_fedlora_defaults_to_every_linear_layer_outside_the_head():
    cfg = digits_config(algorithm={"name": "fedlora", "rank": 2})
    res = run_experiment(cfg, write=False)
    assert any("lora_A" in k for k in res.state["model"])


def test_memory_of_a_known_allocation_is_measured_within_ten_percent():
    r = run_fresh(["--tensor-mb", "128"], timeout=120)
    assert abs(r["peak_mb"] - 128) / 128 < 0.10, r


def write_sst2(root, train_rows, dev_rows):
    for name, rows in (("train.tsv", train_rows), ("dev.tsv", dev_rows)):
        lines = ["sentence\tlabel"] + [f"{s}\t{y}" for s, y in rows]
        (root / name).write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_sst2_loader_reads_glue_tsv_files(tmp_path):
    write_sst2(tmp_path,
               [("a gripping , funny film ", 1), ("dull and dull", 0),
                ("it 's a funny , funny movie that never ends well", 1)],
               [("funny but dull", 1), ("unseen words here", 0)])
    b = load_dataset("sst2", str(tmp_path), max_len=6, vocab_size=8)
    assert b.input_shape == (2, 6) and b.num_classes == 2
    assert b.train.x.shape == (3, 2, 6) and b.test.x.shape == (2, 2, 6)
    assert b.train.y.tolist() == [1, 0, 1] and b.test.y.tolist() == [1, 0]
    ids, mask = b.train.x[1]
    assert ids[0] == BOS and mask.tolist() == [1, 1, 1, 1, 0, 0]
    assert ids[1] == ids[3] and ids[4] == PAD            # "dull" twice, then padding
    assert b.train.x[2, 1].tolist() == [1] * 6            # truncated at max_len
    funny = b.train.x[2, 0, 5]              # "it ' s a funny": the most frequent word
    assert funny == 4
    assert b.test.x[1, 0, 1:4].tolist() == [UNK] * 3      # words not in the train split


def test_sst2_files_spreadsheets_write_and_bad_rows(tmp_path):
    from splitfed.errors import ConfigError, DataError

    write_sst2(tmp_path, [("good film", 1), ("bad film", 0)], [("fine", 1)])
    plain = load_dataset("sst2", str(tmp_path), max_len=4, vocab_size=8)
    train = tmp_path / "train.tsv"
    train.write_bytes(b"\xef\xbb\xbf" + train.read_bytes())        # a UTF-8 BOM
    bom = load_dataset("sst2", str(tmp_path), max_len=4, vocab_size=8)
    assert torch.equal(plain.train.x, bom.train.x)
    for label in ("\u00b2", "01", "2", "-1", "99999999999999999999999"):
        write_sst2(tmp_path, [("good film", 1), ("bad film", label)], [("fine", 1)])
        with pytest.raises(DataError, match=r"malformed rows at lines \[3\] \(each row is "
                                            r"sentence<TAB>label, the label 0 or 1\)"):
            load_dataset("sst2", str(tmp_path), max_len=4, vocab_size=8)
    write_sst2(tmp_path, [("good film", 1), ("bad film", 0)], [])
    with pytest.raises(DataError, match=r"the dev \(the test set\) split holds no rows"):
        load_dataset("sst2", str(tmp_path), max_len=4, vocab_size=8)
    write_sst2(tmp_path, [("good film", 1), ("bad film", 0)], [("fine", 1)])
    (tmp_path / "tok").mkdir()
    with pytest.raises(ConfigError, match=r"^data.tokenizer: cannot load a tokenizer from"):
        load_dataset("sst2", str(tmp_path), max_len=4, tokenizer=str(tmp_path / "tok"))


def test_sst2_loader_reads_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    pd.DataFrame({"sentence": ["good", "bad"], "label": [1, 0], "idx": [0, 1]}).to_parquet(
        tmp_path / "train-00000-of-00001.parquet")
    pd.DataFrame({"sentence": ["good"], "label": [1], "idx": [0]}).to_parquet(
        tmp_path / "validation-00000-of-00001.parquet")
    b = load_dataset("sst2", str(tmp_path), max_len=4)
    assert b.train.y.tolist() == [1, 0] and len(b.test) == 1


@pytest.mark.parametrize("column, values, says", [
    ("sentence", ["good", None], r"row 1 has no sentence text \(got "),      # None or NaN
    ("label", [1.0, 0.5], r"row 1 has the label '0.5'; labels are the integers 0 and 1"),
    ("label", [False, True], r"row 0 has the label 'False'"),
])
def test_sst2_parquet_rows_without_text_or_integer_labels_are_refused(tmp_path, column,
                                                                      values, says):
    from splitfed.errors import DataError

    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    rows = {"sentence": ["good", "bad"], "label": [1, 0], column: values}
    pd.DataFrame(rows).to_parquet(tmp_path / "train-00000-of-00001.parquet")
    pd.DataFrame({"sentence": ["good"], "label": [1]}).to_parquet(
        tmp_path / "validation-00000-of-00001.parquet")
    with pytest.raises(DataError, match=r"train-00000-of-00001.parquet: " + says):
        load_dataset("sst2", str(tmp_path), max_len=4)


def test_synthetic_text_label_is_whether_the_marker_occurs():
    b = load_dataset("synthetic_text", num_train=200, num_test=50, seq_len=12, vocab_size=30)
    for split_ in (b.train, b.test):
        ids, mask = split_.x[:, 0], split_.x[:, 1]
        has = ((ids == 4) & (mask == 1)).any(1).long()
        assert torch.equal(has, split_.y)
        assert (ids[:, 0] == BOS).all() and ((ids == PAD) == (mask == 0)).all()
    assert int(b.train.y.sum()) == 100


@pytest.mark.parametrize("algorithm, dtype", [({"name": "fedlora", "rank": 2}, "float32"),
                                              ({"name": "sflv1"}, "bfloat16"),
                                              ({"name": "sflv1"}, "float32")])
def test_the_plan_counts_the_bytes_a_round_sends(algorithm, dtype):
    # --dry-run's plan (and over-selection's prediction) count what the clients are sent:
    # FedLoRA's adapters and head, activations in the model's dtype
    from splitfed.plan import build_plan

    cfg = text_config(algorithm, model={**TINY, "cut": 1, "dtype": dtype})
    planned = build_plan(cfg)["model"]["bytes"]
    last = run_experiment(cfg, write=False).records[-1]
    clients = last["participants"]
    assert planned["model"] * clients == last["bytes_down/model"] == last["bytes_up/model"]
    if algorithm["name"] == "sflv1":
        assert planned["cut_up"] == (last["bytes_up/activations"] + last["bytes_up/labels"])
        assert planned["cut_down"] == last["bytes_down/activation_grads"]


@pytest.mark.parametrize("option", [{"preset": "tiny"}, {"hidden_size": 64},
                                    {"num_layers": 2}, {"vocab_size": 40},
                                    {"max_positions": 12}])
def test_sizes_beside_a_pretrained_checkpoint_are_refused(tmp_path, option):
    # a pretrained model's sizes come from its config.json: a size option would be ignored
    from splitfed.errors import ConfigError

    hf_tiny(layers=2).save_pretrained(tmp_path)
    (key,) = option
    with pytest.raises(ConfigError, match=rf"^model.{key}: a pretrained model's sizes come "
                                          r"from the config.json in model.pretrained"):
        build_model("opt", (2, 12), 2, pretrained=str(tmp_path), **option)


def test_a_vocabulary_size_beside_a_tokenizer_directory_is_refused():
    from splitfed.data.text import encode
    from splitfed.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^data.vocab_size: the tokenizer directory"):
        encode(["a b"], ["a"], "/nonexistent", 4, 100)
    with pytest.raises(ConfigError, match=r"^data.tokenizer: "):     # no vocabulary size
        encode(["a b"], ["a"], "/nonexistent", 4, None)
    assert encode(["a b"], ["a"], None, 4, None)[0].shape == (1, 2, 4)   # 8192 words
