"""Command line: ``splitfed run | list | partition``.

    splitfed run CONFIG [key=value ...]     run an experiment (CONFIG: a YAML file or a
                                            shipped config name, see ``splitfed list``)
    splitfed run --resume RUN_DIR           continue an interrupted run from its checkpoint
    splitfed sweep CONFIG key=v1,v2 ...     run every combination of the values; a table
                                            of the runs (see docs/sweeps.md)
    splitfed launch CONFIG --nproc N        the same run on N processes of this machine
                                            (torch.distributed, docs/distributed.md)
    splitfed list                           algorithms, data sets, models, partitioners,
                                            participation modes, shipped configs
    splitfed partition CONFIG [key=value]   print the partition summary of a config
    splitfed study STUDY.yaml               run a study (a set of runs), write a table and
                                            plots (see docs/studies.md)
"""

from __future__ import annotations

import argparse
import sys

from splitfed.errors import SplitfedError


def _cmd_run(args) -> int:
    from splitfed.config import load_config
    from splitfed.errors import ConfigError
    from splitfed.experiment import resume_experiment, run_experiment

    if args.resume is not None:
        if args.config is not None or args.overrides:
            raise ConfigError("run --resume RUN_DIR continues the run with RUN_DIR's own "
                              "config.yaml; give no CONFIG or key=value with it")
        result = resume_experiment(args.resume)
        cfg = load_config(result.run_dir / "config.yaml")
    elif args.config is None:
        raise ConfigError("run: give a CONFIG (YAML file or shipped config name), or "
                          "--resume RUN_DIR")
    else:
        cfg = load_config(args.config, args.overrides)
        result = run_experiment(cfg)
    acc = result.final_accuracy
    acc_text = "n/a" if acc is None else f"{acc:.4f}"
    print(f"{cfg.algorithm.name} on {cfg.data.name} ({cfg.model.name}, "
          f"{cfg.partition.num_clients} clients, {cfg.partition.scheme}): "
          f"status {result.status}, test accuracy {acc_text} after "
          f"{result.records[-1]['round']} rounds, wall time {result.wall_time_s:.1f} s")
    print(f"run directory: {result.run_dir}")
    return 0 if result.status == "completed" else 3


def _cmd_list(args) -> int:
    from splitfed.algorithms import ALGORITHMS
    from splitfed.config import shipped_configs
    from splitfed.data import dataset_names
    from splitfed.data.partition import PARTITIONERS
    from splitfed.engine.participation import sampler_names
    from splitfed.models import MODELS, build_model

    print("algorithms:")
    for name, cls in sorted(ALGORITHMS.items()):
        print(f"  {name:<14} {cls.reference}")
    print("datasets:      " + ", ".join(dataset_names()))
    print("models (cuts):")
    for name in sorted(MODELS):
        shape = {"lenet5": (1, 28, 28), "alexnet": (1, 28, 28), "mlp": (1, 28, 28),
                 "opt": (2, 16)}.get(name, (3, 32, 32))   # opt: token ids + attention mask
        m = build_model(name, shape, 10)
        print(f"  {name:<14} default cut {m.default_cut}; valid cuts "
              + ", ".join(str(c) for c in m.valid_cuts))
    print("partitioners:  " + ", ".join(sorted(PARTITIONERS)))
    print("participation: " + ", ".join(sampler_names()))
    print("configs:       " + ", ".join(shipped_configs()))
    return 0


def _cmd_partition(args) -> int:
    import torch

    from splitfed.config import load_config
    from splitfed.data.partition import partition_summary
    from splitfed.experiment import load_data, make_partition
    from splitfed.rng import RandomStreams

    cfg = load_config(args.config, args.overrides)
    streams = RandomStreams(cfg.seed)
    bundle = load_data(cfg, streams, torch.device("cpu"))
    parts = make_partition(cfg, bundle, streams)
    print(partition_summary(parts, bundle.train.y.numpy(), bundle.num_classes))
    return 0


def _cmd_study(args) -> int:
    from splitfed.study import run_study

    result = run_study(args.study, out_dir=args.out_dir, progress=args.progress)
    return 0 if result.completed else 3


def _cmd_sweep(args) -> int:
    from splitfed.errors import ConfigError
    from splitfed.sweep import run_sweep

    seeds = None
    if args.seeds is not None:
        try:
            seeds = [int(s) for s in args.seeds.split(",")]
        except ValueError:
            raise ConfigError(f"--seeds: expected integers separated by commas, e.g. 0,1,2; "
                              f"got {args.seeds!r}") from None
    result = run_sweep(args.config, args.axes, name=args.name, seeds=seeds,
                       out_dir=args.out_dir, group_by=args.group_by,
                       progress=args.progress)
    return 0 if result.completed else 3


def _cmd_plot(args) -> int:
    from splitfed.plot import plot_runs

    axes = [a.strip() for a in args.x.split(",") if a.strip()]
    out = plot_runs(args.runs, args.out, axes=axes, labels=args.label, title=args.title)
    print(f"wrote {out}")
    return 0


def _cmd_launch(args) -> int:
    from splitfed.runtime.launch import launch, worker_argv

    return launch(args.nproc, worker_argv(args), launcher=args.launcher)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitfed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run an experiment")
    r.add_argument("config", nargs="?", help="YAML file or shipped config name")
    r.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=0.05")
    r.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue the run in RUN_DIR from its last checkpoint "
                        "(checkpoint_every), with its config.yaml")
    r.set_defaults(func=_cmd_run)
    sub.add_parser("list", help="list what is available").set_defaults(func=_cmd_list)
    q = sub.add_parser("partition", help="print the partition summary of a config")
    q.add_argument("config")
    q.add_argument("overrides", nargs="*")
    q.set_defaults(func=_cmd_partition)
    s = sub.add_parser("study", help="run a study file, write results.md, results.json, plots")
    s.add_argument("study", help="study YAML file (see docs/studies.md)")
    s.add_argument("--out-dir", default=None,
                   help="write to OUT_DIR/<study name>/ (default: the file's out_dir, "
                        "docs/results)")
    s.add_argument("--progress", action="store_true", help="show each run's progress bar")
    s.set_defaults(func=_cmd_study)
    g = sub.add_parser("plot", help="draw test accuracy of runs against rounds and "
                                    "simulated time")
    g.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files)")
    g.add_argument("--out", "-o", default="accuracy.png",
                   help="image file to write (.png, .pdf, .svg; default: accuracy.png)")
    g.add_argument("--x", default="round,time",
                   help="x axes, comma-separated: round, time, bytes (default: round,time)")
    g.add_argument("--label", action="append", default=None,
                   help="a line label per run, in order (repeat the option)")
    g.add_argument("--title", default=None)
    g.set_defaults(func=_cmd_plot)
    w = sub.add_parser("sweep", help="run a grid of a config's values (docs/sweeps.md)")
    w.add_argument("config", help="YAML file or shipped config name")
    w.add_argument("axes", nargs="+", metavar="key=v1,v2,...",
                   help="values to sweep (every combination is a run); one value: an "
                        "override of every run")
    w.add_argument("--name", default=None, help="sweep directory name "
                                                "(default: <config stem>-sweep)")
    w.add_argument("--seeds", default=None, help="run every point once per seed, e.g. 0,1,2")
    w.add_argument("--out-dir", default=None, help="parent of the sweep directory "
                                                   "(default: runs/sweeps)")
    w.add_argument("--group-by", default=None, metavar="KEY",
                   help="a swept key: one plot panel per value")
    w.add_argument("--progress", action="store_true", help="show each run's progress bar")
    w.set_defaults(func=_cmd_sweep)
    from splitfed.runtime.worker import add_run_arguments

    d = sub.add_parser("launch", help="run on N processes of this machine "
                                      "(torch.distributed; docs/distributed.md)")
    add_run_arguments(d)
    d.add_argument("--nproc", type=int, required=True,
                   help="processes: rank 0 serves, ranks 1..N-1 host the clients")
    d.add_argument("--launcher", choices=("torchrun", "spawn"), default="torchrun",
                   help="torchrun (default; a dead rank stops the group) or spawn (a dead "
                        "client rank is dropped and the run goes on)")
    d.set_defaults(func=_cmd_launch)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.func is _cmd_launch and not any(e.startswith("-") for e in extra):
        args.overrides += extra             # launch CONFIG --nproc N key=value ...
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except SplitfedError as e:
        print(f"splitfed: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
