"""``splitfed run CONFIG --dry-run``: everything a run checks, then what it would do.

:func:`build_plan` builds the run as :func:`splitfed.experiment.run_experiment` does
before it creates the run directory (the algorithm with its options and transforms, the
data, the partition, the sampler, the model and its cut, the clock; the checks against
the data and this machine's memory; the algorithm's own check; its initial state) and
checks that the run directory could be created, without creating it. Nothing is trained
and nothing is written. :func:`format_plan` prints what the run would do: the algorithm and its
transforms, the data set, the clients' data sizes, the participants, local steps and
training samples of a round, the model's parameters (each side of the cut for split
algorithms), the multiply-accumulates per sample and the clients' of a round, the bytes
a round moves, the rounds and where the run would write.

The bytes are those the model implies (as :func:`splitfed.engine.loop.client_work`
computes them for over-selection): each participant downloads and uploads the
algorithm's client part of the model (the whole model, the client blocks of a split
algorithm, FedLoRA's adapters and head) once a round, and a split algorithm moves what
its ``cut_bytes`` says (SL and SFL: every training sample's activations, in the model's
dtype, and label up and their gradient down; MU-SplitFed and GAS: 2 q + 1 activation
tensors and the labels up and q scalars down per step; CSE-FSL: one batch in its upload
rounds), on average over the run's rounds and the participation's clients; the
gradient transforms add what their ``message_bytes`` says (SCAFFOLD's control variates
both ways, FedCLG-C's server gradient down, FedCLG-S's client gradients up). The
clients' compute of a round is the algorithm's ``client_macs``
(one forward and one backward pass per training sample, or what its clients compute
instead: MU-SplitFed's and GAS's 2 q + 1 forward passes, CSE-FSL's auxiliary heads),
and the samples its gradient transforms add (their ``client_samples``: FedCLG's pass
for g^i_t with ``client_gradient: fresh_batch`` or ``full``), on average over the
rounds and the participation's clients as the bytes are.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from splitfed.experiment import STAMP   # the time in a run directory's name, as shown


def build_plan(cfg, overrides: list[str] | None = None) -> dict:
    """Build and check the run of ``cfg`` as a run would, and return its plan (plain
    data: numbers, strings, lists); ``overrides``: the command line's ``key=value`` items,
    which name the run directory as they would name the run's. Raises what the run would
    raise before it starts (:class:`~splitfed.errors.ConfigError` and the like); writes
    nothing."""
    from splitfed.engine.loop import initial_state
    from splitfed.experiment import (RUN_FILES, build_algorithm, build_environment,
                                     check_algorithm_env)
    from splitfed.origins import call_algorithm
    from splitfed.tracking import preflight, remote_store

    algorithm = build_algorithm(cfg)
    env = build_environment(cfg)
    check_algorithm_env(algorithm, env)
    call_algorithm(cfg.algorithm.name, "prepare_model",   # the model as the run trains
                   algorithm.prepare_model, env)           # it (FedLoRA's adapters)
    initial_state(algorithm, env)                         # as the run, before its directory
    run_dir = check_out_dir(cfg, overrides)
    if remote_store(cfg):                                 # an MLflow server, as the run
        preflight(cfg)
    files = [f for f in RUN_FILES if f != "checkpoint.pt" or cfg.checkpoint_every]
    tracking = getattr(cfg, "tracking", None)              # experiment trackers
    if getattr(tracking, "tensorboard", False):
        files.append("tensorboard/")
    if getattr(tracking, "mlflow", False):
        uri = getattr(tracking, "mlflow_uri", None)
        files.append(f"an MLflow run at {uri}" if uri else "mlruns/")
    return {
        "name": cfg.name,
        "algorithm": _algorithm(cfg, algorithm),
        "data": _data(env),
        "clients": _clients(cfg, algorithm, env),
        "model": _model(algorithm, env),
        "rounds": cfg.rounds, "eval_every": cfg.eval_every, "eval_last": cfg.eval_last,
        "checkpoint_every": cfg.checkpoint_every,
        "clock": {"profile": cfg.clock.profile, "deadline": cfg.clock.deadline,
                  "over_select": cfg.clock.over_select},
        "device": str(env.device),
        "run_dir": str(run_dir), "out_dir_exists": Path(cfg.out_dir).is_dir(),
        "files": files,
    }


def run_dir_name(cfg, overrides: list[str] | None = None) -> str:
    """The name of the run directory a run would create, the time as :data:`STAMP`."""
    from splitfed.experiment import run_dir_name as name

    return f"{name(cfg, overrides)}-{STAMP}"


def check_out_dir(cfg, overrides: list[str] | None = None) -> Path:
    """:func:`splitfed.experiment.check_out_dir`: the run directory a run would create,
    checked as the run checks it."""
    from splitfed.experiment import check_out_dir as check

    return check(cfg, overrides)


def short(text: str, most: int | None = None) -> str:
    """:func:`splitfed.experiment.short`: ``text`` cut for an error message."""
    from splitfed.experiment import SHOWN_CHARS, short as cut

    return cut(text, SHOWN_CHARS if most is None else most)


# ------------------------------------------------------------------------------ parts


def _options(obj) -> dict:
    import dataclasses

    from splitfed.configtools import to_dict

    return to_dict(obj) if dataclasses.is_dataclass(obj) else {}


def _algorithm(cfg, algorithm) -> dict:
    return {"name": algorithm.name, "reference": getattr(algorithm, "reference", ""),
            "split": bool(algorithm.split), "federated": bool(algorithm.federated),
            "uses_transforms": bool(algorithm.uses_transforms),
            "options": _options(algorithm.options),
            "client_transforms": [{"name": t.name, **_options(t.options)}
                                  for t in algorithm.gradient_transforms],
            "server_transforms": [{"name": t.name, **_options(t.options)}
                                  for t in algorithm.server_steps]}


def _data(env) -> dict:
    bundle = env.data
    out = {"name": bundle.name, "train": int(len(bundle.train.y)),
           "test": int(len(bundle.test.y)),
           "input_shape": [int(s) for s in bundle.input_shape],
           "classes": int(bundle.num_classes)}
    server = env.server_data
    if server is not None:
        out["server_pool"] = int(len(server.pool))
        out["server_samples_per_round"] = int(server.samples_per_round)
    return out


def _spread(values) -> dict:
    v = np.asarray(values, dtype=np.float64)
    return {"min": int(v.min()), "median": float(np.median(v)), "max": int(v.max()),
            "total": int(v.sum())}


def _clients(cfg, algorithm, env) -> dict:
    from splitfed.engine.loop import local_steps_of

    sizes = env.data_sizes
    n = len(sizes)
    steps = local_steps_of(algorithm, env, np.arange(n))
    batch = cfg.train.batch_size
    work = steps.astype(np.int64) * batch                 # samples each client trains on
    pc = cfg.participation
    sampler = env.sampler
    order = np.sort(work)
    if pc.mode == "full":
        per_round = {"mean": float(n), "min": n, "max": n}
        samples = {"mean": float(work.sum()), "min": int(work.sum()), "max": int(work.sum())}
    elif pc.mode == "uniform":
        m = int(sampler.m)
        per_round = {"mean": float(m), "min": m, "max": m}
        samples = {"mean": float(work.mean() * m), "min": int(order[:m].sum()),
                   "max": int(order[-m:].sum())}
    elif pc.mode == "with_replacement":
        m = int(sampler.m)
        per_round = {"mean": float(m), "min": m, "max": m}
        samples = {"mean": float(work.mean() * m), "min": int(order[0] * m),
                   "max": int(order[-1] * m)}
    else:                                                 # bernoulli
        q = np.asarray(sampler.q, dtype=np.float64)
        per_round = {"mean": float(q.sum()), "min": int((q >= 1).sum()), "max": n}
        samples = {"mean": float((q * work).sum()), "min": int(work[q >= 1].sum()),
                   "max": int(work.sum())}
    kept = None
    if env.clock.keep is not None:                        # over-selection keeps M of them
        kept = int(env.clock.keep)
        samples = {"mean": float(work.mean() * kept), "min": int(order[:kept].sum()),
                   "max": int(order[-kept:].sum())}
    return {"count": n, "scheme": cfg.partition.scheme,
            "scheme_options": dict(cfg.partition.options),
            "data": _spread(sizes), "local_steps": _spread(steps),
            "batch_size": batch, "local_steps_given": cfg.train.local_steps,
            "local_steps_fixed": algorithm.fixed_local_steps,
            "local_epochs": cfg.train.local_epochs,
            "participation": pc.mode, "per_round": per_round, "kept": kept,
            "samples_per_round": samples,
            "server_alone": not algorithm.federated}


def _params(module) -> int:
    return int(sum(p.numel() for p in module.parameters()))


def _model(algorithm, env) -> dict:
    from splitfed.engine.loop import (client_work, local_steps_of, macs_per_sample,
                                      step_client_samples, step_message_bytes)
    from splitfed.models import split

    model = env.model
    out = {"name": getattr(model, "name", type(model).__name__),
           "parameters": _params(model), "cut": None, "cut_description": None}
    client_macs, server_macs = macs_per_sample(algorithm, env)
    out["macs_per_sample"] = {"client": int(client_macs), "server": int(server_macs)}
    if algorithm.split:
        client, server = split(model, env.cut)
        out.update(cut=int(env.cut),
                   cut_description=getattr(model, "cut_descriptions", {}).get(env.cut),
                   client_parameters=_params(client), server_parameters=_params(server))
    if algorithm.federated:
        ids = np.arange(len(env.data_sizes))
        steps = local_steps_of(algorithm, env, ids)
        macs, model_bytes, up, down, (extra_down, extra_up) = client_work(
            algorithm, env, steps, ids=ids)
        share = _round_share(env)
        out["client_macs_per_round"] = float((share * macs).sum())
        transforms = algorithm.gradient_transforms
        out["client_samples_of"] = [t.name for t in transforms
                                    if step_client_samples(t, env, ids).any()]
        out["bytes"] = {"model": int(model_bytes), "cut_up": float((share * up).sum()),
                        "cut_down": float((share * down).sum()),
                        "messages_down": int(extra_down), "messages_up": int(extra_up),
                        "messages_of": [t.name for t in transforms
                                        if any(step_message_bytes(t, env, model_bytes))]}
    return out


def _round_share(env) -> np.ndarray:
    """How many slots of a round each client takes on average: 1 under full
    participation, M / N uniformly or with replacement (and with over-selection, which
    keeps M), q_n under bernoulli participation."""
    n = len(env.data_sizes)
    sampler, mode = env.sampler, env.config.participation.mode
    if env.clock.keep is not None:
        return np.full(n, env.clock.keep / n)
    if mode == "full":
        return np.ones(n)
    if mode == "bernoulli":
        return np.broadcast_to(np.asarray(sampler.q, dtype=np.float64), (n,))
    return np.full(n, sampler.m / n)


# ----------------------------------------------------------------------------- text


def format_plan(plan: dict, config: str | None = None) -> str:
    """The plan as lines of ``label  value`` (what ``--dry-run`` prints)."""
    a, d, c, m = plan["algorithm"], plan["data"], plan["clients"], plan["model"]
    rows = []
    kind = ("split" if a["split"] else "federated" if a["federated"]
            else "no clients: the server trains alone")
    opts = _kv(a["options"])
    rows.append(("algorithm", f"{a['name']} ({kind})" + (f"; {opts}" if opts else "")
                 + (f"; {a['reference']}" if a["reference"] else "")))
    if a["uses_transforms"]:
        rows.append(("transforms", "clients: " + _chain(a["client_transforms"])
                     + "; server: " + _chain(a["server_transforms"])))
    else:
        rows.append(("transforms", f"none ({a['name']} runs its own round and takes none)"))
    shape = "x".join(str(s) for s in d["input_shape"])
    data = (f"{d['name']}: {d['train']} training and {d['test']} test samples, "
            f"input {shape}, {d['classes']} classes")
    if "server_pool" in d:
        data += (f"; the server's pool: {d['server_pool']} samples, "
                 f"{d['server_samples_per_round']} a round")
    rows.append(("data", data))
    sizes = c["data"]
    scheme = c["scheme"] + (f" ({_kv(c['scheme_options'])})" if c["scheme_options"] else "")
    rows.append(("clients", f"{c['count']}, {scheme}: samples min {sizes['min']}, median "
                            f"{_num(sizes['median'])}, max {sizes['max']} "
                            f"(total {sizes['total']})"))
    if c["server_alone"]:
        rows.append(("participation", "none (no client trains: the server does)"))
    else:
        per = c["per_round"]
        text = f"{c['participation']}: {_range(per)} clients a round"
        if c["kept"] is not None:
            text += f", the {c['kept']} predicted fastest kept (clock.over_select)"
        rows.append(("participation", text))
    if not c["server_alone"]:
        k = c["local_steps"]
        how = (f"local_steps={c['local_steps_given']}" if c["local_steps_given"] is not None
               else f"local_epochs={_num(c['local_epochs'])}")
        if c.get("local_steps_fixed") is not None:
            how = (f"{a['name']} takes {c['local_steps_fixed']} a round; train.local_steps "
                   "and local_epochs do not apply")
        rows.append(("local steps", f"K per client min {k['min']}, median "
                                    f"{_num(k['median'])}, max {k['max']} ({how}, "
                                    f"batch_size {c['batch_size']})"))
        rows.append(("samples/round", f"{_range(c['samples_per_round'])} "
                                      "(K x batch_size over the round's clients)"))
    model = f"{m['name']}: {m['parameters']:,} parameters"
    if m["cut"] is not None:
        model += (f"; cut {m['cut']}" + (f" ({m['cut_description']})"
                                         if m["cut_description"] else "")
                  + f": clients {m['client_parameters']:,}, server "
                    f"{m['server_parameters']:,}")
    rows.append(("model", model))
    macs = m["macs_per_sample"]
    text = (f"MACs per training sample (forward and backward): client {macs['client']:,}, "
            f"server {macs['server']:,}")
    if "client_macs_per_round" in m:
        extra = m.get("client_samples_of")
        text += (f"; all clients of a round: {round(m['client_macs_per_round']):,} "
                 f"(what {a['name']}'s clients compute"
                 + (f", with their own passes for {', '.join(extra)})" if extra else ")"))
    rows.append(("compute", text))
    if "bytes" in m:
        b = m["bytes"]
        what = "its part of the model" if m["cut"] is not None else "the model"
        text = f"per client and round, {what}: {_bytes(b['model'])} down, " \
               f"{_bytes(b['model'])} up"
        extra = b["messages_down"] + b["messages_up"]
        if extra:
            text += (f", and the messages of {', '.join(b['messages_of'])}: "
                     f"{_bytes(b['messages_down'])} down, {_bytes(b['messages_up'])} up")
        if b["cut_up"] or b["cut_down"]:
            text += (f"; at the cut, all clients of a round: {_bytes(b['cut_up'])} up, "
                     f"{_bytes(b['cut_down'])} down (what {a['name']} sends there)")
        clients = c["kept"] if c["kept"] is not None else c["per_round"]["mean"]
        total = (2 * b["model"] + extra) * clients + b["cut_up"] + b["cut_down"]
        text += f"; about {_bytes(total)} a round"
        rows.append(("communication", text))
    ck = plan["checkpoint_every"]
    last = plan.get("eval_last") or 0
    every = f"evaluated every {plan['eval_every']}" + (
        f" and each of the last {last}" if last else "")
    rows.append(("rounds", f"{plan['rounds']} ({every}; "
                           + (f"checkpoint every {ck})" if ck else "no checkpoints)")))
    clock = plan["clock"]
    rows.append(("clock", f"{clock['profile']}, deadline "
                          f"{'none' if clock['deadline'] is None else _num(clock['deadline'])}"
                          + (f", over_select {_num(clock['over_select'])}"
                             if clock["over_select"] else "")))
    rows.append(("device", plan["device"]))
    made = "" if plan["out_dir_exists"] else " (out_dir would be created)"
    rows.append(("would write", f"{plan['run_dir']}/{made}: {', '.join(plan['files'])}"))
    width = max(len(label) for label, _ in rows) + 2
    what = f" of {config}" if config else ""
    head = (f"dry run{what}: config, data, partition, model and algorithm built and "
            "checked; nothing trained, nothing written")
    return "\n".join([head, *(f"{label.ljust(width)}{value}" for label, value in rows)]) + "\n"


def _kv(options: dict) -> str:
    from splitfed.explain import yaml_value

    return ", ".join(f"{k}={yaml_value(v)}" for k, v in options.items())


def _chain(transforms: list[dict]) -> str:
    if not transforms:
        return "none"
    out = []
    for t in transforms:
        opts = _kv({k: v for k, v in t.items() if k != "name"})
        out.append(f"{t['name']}({opts})")
    return " -> ".join(out)


def _num(x) -> str:
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return f"{x:g}" if isinstance(x, float) else str(x)


def _range(r: dict) -> str:
    if r["min"] == r["max"]:
        return f"{r['min']:,}"
    mean = f"{round(r['mean']):,}" if r["mean"] >= 100 else _num(round(r["mean"], 1))
    return f"about {mean} ({r['min']:,} to {r['max']:,})"


def _bytes(n: float) -> str:
    n = float(n)
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.{max(0, 3 - len(str(int(n // size))))}f} {unit}"
    return f"{int(round(n))} B"


def dry_run(cfg, config: str | None = None, overrides: list[str] | None = None) -> str:
    """:func:`build_plan` then :func:`format_plan`: the text ``--dry-run`` prints."""
    return format_plan(build_plan(cfg, overrides), config)


__all__ = ["build_plan", "check_out_dir", "dry_run", "format_plan", "run_dir_name", "short"]
