"""Command line: ``splitfed run | sweep | study | launch | list | partition | plot |
results | config``.

    splitfed run CONFIG [key=value ...]     run an experiment (CONFIG: a YAML file or a
                                            shipped config name, see ``splitfed list``)
    splitfed run CONFIG ... --dry-run       build and check everything a run checks, print
                                            its plan (clients, samples, parameters, bytes
                                            per round, where it would write); nothing is
                                            trained or written
    splitfed run --resume RUN_DIR           continue an interrupted run from its checkpoint
    splitfed sweep CONFIG key=v1,v2 ...     run every combination of the values; a table
                                            of the runs (see docs/sweeps.md)
    splitfed launch CONFIG --nproc N        the same run on N processes of this machine
                                            (torch.distributed, docs/distributed.md)
    splitfed list                           algorithms, transforms, data sets, models,
                                            partitioners, participation modes, clock profiles,
                                            shipped configs (plugins' entries marked)
    splitfed partition CONFIG [key=value]   print the partition summary of a config
    splitfed study STUDY.yaml               run a study (a set of runs), write a table and
                                            plots (see docs/studies.md)
    splitfed plot RUN_DIR ... -o FILE       draw runs' test accuracy (--force overwrites)
    splitfed results DIR_OR_GLOB ...        the runs' results: a table, or every record as
                                            CSV (--format csv; --last: each run's last)
    splitfed config show CONFIG [key=value] print the resolved config (YAML)
    splitfed config explain [NAME]          every key with its type, default, bounds and
                                            help; NAME: a section, or an algorithm,
                                            transform, model, data set, partitioner or
                                            clock profile with its options (--markdown:
                                            as docs/config.md)
    splitfed --version                      the installed version

``--plugin MODULE`` (run, sweep, study, launch, list, partition, config; repeatable)
imports a module (by name, from this Python environment) that registers algorithms,
models, data sets, partitioners or clock profiles before the config is read, and adds it
to the config's ``plugins``; installed packages' entry points of the group
``splitfed.plugins`` are imported by every command that reads a config or names a
component (not by ``results`` and ``plot``, which read run directories only;
docs/extending.md).

Exit status: 0 done, 3 a run did not complete (diverged, no_client_trained), 2 an error
(one line: splitfed: error: ...), 130 interrupted (Ctrl-C; an interrupted run, sweep or
study continues where it stopped, the line printed says how), 143 the same after SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys

from splitfed.errors import RunInterrupted, SplitfedError, sigterm_interrupts
from splitfed.files import escape_controls, is_user_os_error, os_error_message
from splitfed.registry import add_plugin_argument

#: exit status of an interrupted command (128 + SIGINT, as a shell reports Ctrl-C)
INTERRUPTED = 130
#: the exit status after SIGTERM (128 + 15), which stops a command as Ctrl-C does
TERMINATED = 143
#: exit status when stdout was closed by its reader (128 + SIGPIPE, as a shell reports it)
BROKEN_PIPE = 141


def _cmd_run(args) -> int:
    from splitfed.config import load_config
    from splitfed.errors import ConfigError

    if args.resume is not None:
        if args.config is not None or args.overrides:
            raise ConfigError("run --resume RUN_DIR continues the run with RUN_DIR's own "
                              "config.yaml; give no CONFIG or key=value with it")
        if args.dry_run:
            raise ConfigError("run --dry-run checks a CONFIG; it does not take --resume "
                              "(run --dry-run RUN_DIR/config.yaml checks a run's config)")
        from splitfed.experiment import resume_experiment

        result = resume_experiment(args.resume)
        cfg = load_config(result.run_dir / "config.yaml")
    elif args.config is None:
        raise ConfigError("run: give a CONFIG (YAML file or shipped config name), or "
                          "--resume RUN_DIR")
    else:
        cfg = load_config(args.config, args.overrides,   # checked before torch loads
                          plugins=args.plugin)
        if args.dry_run:
            from splitfed.plan import dry_run

            sys.stdout.write(dry_run(cfg, args.config, args.overrides))
            return 0
        from splitfed.experiment import run_experiment

        result = run_experiment(cfg, overrides=args.overrides)
    from splitfed.experiment import summary_line

    args.outcome = 0 if result.status == "completed" else 3   # a Ctrl-C now changes nothing
    print(summary_line(cfg, result))
    print(f"run directory: {result.run_dir}")
    return args.outcome


def _cmd_config(args) -> int:
    from splitfed.config import load_config
    from splitfed.configtools import dump_text, to_dict

    cfg = load_config(args.config, args.overrides, plugins=args.plugin)
    from splitfed.experiment import build_algorithm, check_partition_options

    build_algorithm(cfg)                # its name, options and transforms, as a run would
    check_partition_options(cfg)
    sys.stdout.write(dump_text(to_dict(cfg), sort_keys=False))
    return 0


def _cmd_explain(args) -> int:
    from splitfed import explain

    if args.markdown:
        sys.stdout.write(explain.markdown(args.name, builtin_only=False))
        return 0
    text = explain.explain(args.name)
    if args.name is not None:
        _, found = explain.lookup(args.name)
        for kind, name in found:
            if kind == "model":
                text += f"  cuts: {_model_cuts(name, detail=True)}\n"
    sys.stdout.write(text)
    return 0


def _cmd_results(args) -> int:
    from splitfed.errors import ConfigError

    try:
        from splitfed.results import print_table
    except ModuleNotFoundError as e:
        if e.name in ("splitfed.results", "splitfed"):
            raise ConfigError("results: this installation of splitfed has no "
                              "splitfed.results module; update splitfed") from None
        raise ConfigError(f"results: needs the package {e.name!r}, which is not "
                          f"installed: pip install {e.name}") from None
    print_table(args.paths, fmt=args.format, last=args.last)
    return 0


def _cmd_list(args) -> int:
    from splitfed import catalog
    from splitfed.config import shipped_configs
    from splitfed.registry import plugin_entries

    origins = {kind: plugin_entries(kind) for kind in catalog.KINDS}
    listed = None
    if not (getattr(args, "plugin", None) or any(origins.values())
            or any(m in sys.modules for m in catalog.REGISTRY_MODULES)):
        listed = catalog.stored()       # no plugin in play: the built-ins, without torch
    if listed is None:
        listed = catalog.live()         # imports the registries (and torch), builds models
    sys.stdout.write(catalog.render(listed, origins)
                     + "configs:       " + ", ".join(shipped_configs()) + "\n")
    return 0


def _model_cuts(name: str, detail: bool = False) -> str:
    """The cuts of model ``name`` as ``list`` (or, with ``detail``, ``config explain``)
    prints them (:func:`splitfed.catalog.model_cuts`)."""
    from splitfed.catalog import model_cuts

    return model_cuts(name, detail)


def _cmd_partition(args) -> int:
    from splitfed.config import load_config

    cfg = load_config(args.config, args.overrides, plugins=args.plugin)  # before torch
    import torch

    from splitfed.data.partition import partition_summary
    from splitfed.experiment import client_data, load_data
    from splitfed.rng import RandomStreams

    streams = RandomStreams(cfg.seed)
    bundle = load_data(cfg, streams, torch.device("cpu"))
    parts = client_data(cfg, bundle, streams)[1]        # after the server's pool, if any
    print(partition_summary(parts, bundle.train.y.numpy(), bundle.num_classes))
    return 0


def _cmd_study(args) -> int:
    from splitfed.configtools import load_yaml

    load_yaml(args.study)                      # a malformed file: answered before torch loads
    if args.set:
        from splitfed.configtools import parse_overrides

        parse_overrides(args.set)              # a malformed KEY=VALUE too
    from splitfed.study import run_study

    result = run_study(args.study, out_dir=args.out_dir, progress=args.progress,
                       plugins=args.plugin, keep_stale=args.keep_stale,
                       publish_to=args.publish, overrides=args.set,
                       **_parallel_settings(args))
    return 0 if result.completed else 3


def _add_reuse_arguments(parser) -> None:
    parser.add_argument("--keep-stale", action="store_true",
                        help="reuse finished runs made by another splitfed version or "
                             "commit, marked stale in the tables (default: rerun them)")
    parser.add_argument("--publish", default=None, metavar="DIR",
                        help="then copy the tables and plots (not the runs) to "
                             "DIR/<name>/, e.g. docs/results")


def _positive(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    value = int(text) if text.isascii() and text.isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _add_parallel_arguments(parser) -> None:
    """--jobs, --threads, --executor, --address (checked again, with the upper bounds, by
    splitfed.study.parallel.check_options; not imported here: it imports torch)."""
    parser.add_argument("--jobs", type=_positive, default=None, metavar="N",
                        help="runs at the same time, each in a worker process (default: "
                             "the usable cores, at most the runs left; 1: one after the "
                             "other in this process)")
    parser.add_argument("--threads", type=_positive, default=1, metavar="T",
                        help="PyTorch threads of each run (default 1, whatever --jobs, so "
                             "that results do not depend on it)")
    parser.add_argument("--executor", choices=("local", "dask"), default=None,
                        help="local (default: worker processes of this machine) or dask "
                             "(a Dask cluster: --address, else DASK_SCHEDULER_ADDRESS, "
                             "else a local cluster of --jobs workers on 127.0.0.1; "
                             "pip install 'splitfed[cluster]')")
    parser.add_argument("--address", default=None, metavar="ADDR",
                        help="with --executor dask: the scheduler, e.g. tcp://10.0.0.5:8786 "
                             "(docs/studies.md: trusted clusters only)")


def _parallel_settings(args) -> dict:
    return {"jobs": args.jobs, "threads": args.threads, "executor": args.executor,
            "address": args.address}


def _cmd_sweep(args) -> int:
    from splitfed.errors import ConfigError
    from splitfed.grid import parse_axes

    parse_axes(args.axes)                      # a malformed value: answered before torch loads
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
                       progress=args.progress, plugins=args.plugin,
                       keep_stale=args.keep_stale, publish_to=args.publish,
                       **_parallel_settings(args))
    return 0 if result.completed else 3


def _cmd_plot(args) -> int:
    from splitfed.plot import plot_runs

    axes = [a.strip() for a in args.x.split(",") if a.strip()]
    out = plot_runs(args.runs, args.out, axes=axes, labels=args.label, title=args.title,
                    force=args.force)
    print(f"wrote {out}")
    return 0


def _cmd_launch(args) -> int:
    if args.config is not None and args.resume is None:
        from splitfed.config import resolve_config_path
        from splitfed.configtools import load_yaml

        load_yaml(resolve_config_path(args.config))   # a malformed file: before torch loads
    from splitfed.runtime.launch import launch

    return launch(args)


class _Parser(argparse.ArgumentParser):
    """argparse with errors on one line, like every other error of the command."""

    def error(self, message: str):
        command = self.prog.removeprefix("splitfed").strip()
        where = f"{command}: " if command else ""
        print(f"splitfed: error: {where}{message} (see: {self.prog} --help)",
              file=sys.stderr)
        raise SystemExit(2)


def _load_plugins(args) -> None:
    """Import the entry points of the group ``splitfed.plugins`` and the ``--plugin``
    modules, before any command reads a config. ``results`` and ``plot`` read run
    directories only: they import none (a broken installed plugin does not stop them)."""
    from splitfed.registry import load_entry_points, load_plugins

    if getattr(args, "command", None) in ("results", "plot"):
        return
    load_entry_points()
    load_plugins(getattr(args, "plugin", None) or [])


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="splitfed", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    from splitfed import __version__

    p.add_argument("--version", action="version", version=f"splitfed {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("config", help="print the resolved config of CONFIG [key=value ...] "
                                      "(show) or what every key means (explain)")
    actions = c.add_subparsers(dest="action", required=True, metavar="{show,explain}")
    cs = actions.add_parser("show", help="the config as a run would use it (YAML, every "
                                         "key with its value)")
    cs.add_argument("config", help="YAML file or shipped config name")
    cs.add_argument("overrides", nargs="*", help="key=value overrides (~key removes a key)")
    add_plugin_argument(cs)
    cs.set_defaults(func=_cmd_config)
    ce = actions.add_parser("explain", help="every key with its type, default, bounds and "
                                            "help; or one section or component")
    ce.add_argument("name", nargs="?", default=None,
                    help="a section (run, algorithm, data, partition, model, train, ...) or "
                         "an algorithm, transform, model, data set, partitioner or clock "
                         "profile (splitfed list); default: every section")
    ce.add_argument("--markdown", action="store_true",
                    help="print markdown, as docs/config.md (which is generated by "
                         "python -m splitfed.explain)")
    add_plugin_argument(ce)
    ce.set_defaults(func=_cmd_explain)
    r = sub.add_parser("run", help="run an experiment")
    r.add_argument("config", nargs="?", help="YAML file or shipped config name")
    r.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=0.05")
    r.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue the run in RUN_DIR from its last checkpoint "
                        "(checkpoint_every), with its config.yaml")
    r.add_argument("--dry-run", action="store_true",
                   help="build and check everything the run would (config, data, "
                        "partition, model, algorithm, memory bounds, out_dir) and print "
                        "its plan; train nothing, write nothing")
    add_plugin_argument(r)
    r.set_defaults(func=_cmd_run)
    li = sub.add_parser("list", help="list what is available")
    add_plugin_argument(li)
    li.set_defaults(func=_cmd_list)
    q = sub.add_parser("partition", help="print the partition summary of a config")
    q.add_argument("config")
    q.add_argument("overrides", nargs="*")
    add_plugin_argument(q)
    q.set_defaults(func=_cmd_partition)
    s = sub.add_parser("study", help="run a study file, write results.md, results.json, plots")
    s.add_argument("study", help="study YAML file (see docs/studies.md)")
    s.add_argument("--out-dir", default=None,
                   help="write to OUT_DIR/<study name>/ (default: the file's out_dir, "
                        "runs/studies)")
    s.add_argument("--progress", action="store_true",
                   help="show each run's progress bar (--jobs 1; else a line per run)")
    s.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                   help="a config override for every run, after the file's overrides "
                        "(repeat for several), e.g. --set engine.device=cuda; recorded "
                        "in the results' study.yaml and command")
    _add_reuse_arguments(s)
    _add_parallel_arguments(s)
    add_plugin_argument(s)
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
    g.add_argument("--force", action="store_true",
                   help="overwrite the output file if it exists (default: refuse)")
    g.set_defaults(func=_cmd_plot)
    t = sub.add_parser("results", help="the runs' results: a table, or every record as "
                                       "CSV (docs/results_data.md)")
    t.add_argument("paths", nargs="+", metavar="DIR_OR_GLOB",
                   help="run directories, metrics.jsonl files, directories holding runs "
                        "(a sweep, a study, runs/), or globs such as 'runs/fedavg_*'")
    t.add_argument("--last", action="store_true",
                   help="one row per run, its last round (default: one row per round)")
    t.add_argument("--format", choices=("table", "csv"), default="table",
                   help="table (default: accuracy, bytes, simulated time) or csv (every "
                        "column: records, config keys, provenance)")
    t.set_defaults(func=_cmd_results)
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
    w.add_argument("--progress", action="store_true",
                   help="show each run's progress bar (--jobs 1; else a line per run)")
    _add_reuse_arguments(w)
    _add_parallel_arguments(w)
    add_plugin_argument(w)
    w.set_defaults(func=_cmd_sweep)
    from splitfed.runtime.worker import add_network_arguments, add_run_arguments

    d = sub.add_parser("launch", help="run on N processes of this machine "
                                      "(torch.distributed; docs/distributed.md)")
    add_run_arguments(d)
    add_network_arguments(d)
    d.add_argument("--nproc", type=int, required=True,
                   help="processes (2 to 256): rank 0 serves, ranks 1..N-1 host the "
                        "clients")
    d.add_argument("--launcher", choices=("torchrun", "spawn"), default="torchrun",
                   help="torchrun (default; a dead rank stops the group) or spawn (a dead "
                        "client rank is dropped and the run goes on)")
    d.set_defaults(func=_cmd_launch)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status: 0 done, 3 a run did not complete
    (diverged), 2 a user error (one line on stderr: ``splitfed: error: ...``), 130
    interrupted (Ctrl-C; the line says how to continue), 143 the same after SIGTERM, 141
    stdout closed by its reader.
    An exception of any other kind is a bug and keeps its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _tolerant_output()
    args, terminated = None, []
    try:
        parser = build_parser()
        try:
            args, extra = parser.parse_known_args(argv)
            if (extra and args.func in (_cmd_launch, _cmd_run, _cmd_partition, _cmd_config)
                    and not any(e.startswith("-") for e in extra)):
                args.overrides += extra             # run CONFIG --dry-run key=value ...
            elif (extra and args.func is _cmd_sweep
                  and not any(e.startswith("-") for e in extra)):
                args.axes += extra                  # sweep CONFIG a=1 --jobs 2 b=3,4
            elif extra:
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
        except SystemExit as e:                     # --help, or a usage error (printed)
            return e.code if isinstance(e.code, int) else 2
        _load_plugins(args)
        with sigterm_interrupts() as terminated:
            return args.func(args)
    except (KeyboardInterrupt, RunInterrupted) as e:
        if getattr(args, "outcome", None) is not None:     # the run had ended and saved all
            return args.outcome
        line = _interrupted(args, argv, e)
        if terminated:
            print(f"splitfed: terminated{line.removeprefix('interrupted')}", file=sys.stderr)
            return TERMINATED
        print(f"splitfed: {line}", file=sys.stderr)
        return INTERRUPTED
    except SplitfedError as e:
        print(f"splitfed: error: {_printable(str(e))}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        return BROKEN_PIPE                          # e.g. splitfed list | head -1
    except OSError as e:
        if not is_user_os_error(e):
            raise                                   # not about the user's files: a bug
        print(f"splitfed: error: {_printable(os_error_message(e))}", file=sys.stderr)
        return 2


def entry() -> None:
    """The ``splitfed`` command: :func:`main`, then exit with its status. Once ``main``
    has returned, the command's work is done and reported, so Ctrl-C and SIGTERM are
    ignored while the interpreter shuts down (about a second, after a run): a signal
    then would turn a finished command's status into an interruption. (Ignored, not
    handled: the interpreter resets its own handlers to the default action, which kills
    the process, before it has finished shutting down.)"""
    code = main()
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(code)


def _printable(message: str) -> str:
    """``message`` with its control characters but newline escaped
    (:func:`splitfed.files.escape_controls`): a value echoed from a user's file cannot send the
    terminal escape sequences or break a line in the middle (a carriage return, a form
    feed); the newlines are the message's own (a list of failed runs)."""
    return escape_controls(message, newlines=True)


def _tolerant_output() -> None:
    """Text that is not valid UTF-8 (a directory name from another system, a lone
    surrogate escape in a JSON file) is printed with backslash escapes instead of
    stopping the command with a UnicodeEncodeError. A closed standard output or error
    (``splitfed list >&-``: Python then has no stream) discards what is written to it,
    as ``print`` does, instead of failing on the first write."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(ValueError, OSError):
                reconfigure(errors="backslashreplace")


def _interrupted(args, argv: list[str], e: BaseException) -> str:
    """The line printed on Ctrl-C: how to continue what was interrupted."""
    command = getattr(args, "command", None)
    if command in ("sweep", "study"):
        again = shlex.join(["splitfed", *argv])
        return (f"interrupted; finished runs are kept, continue the {command} by running "
                f"the same command again: {again}")
    if isinstance(e, RunInterrupted):
        return str(e)
    if command == "run" and getattr(args, "resume", None) is not None:
        return f"interrupted; continue it with: splitfed run --resume {args.resume}"
    return "interrupted"


def _stdout_closed() -> bool:
    """True when stdout is a pipe whose reader has gone; stdout is then pointed at
    /dev/null, so that the interpreter's last flush prints nothing either."""
    import select

    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        closed = any(event & select.POLLERR for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False
    if closed:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return closed


if __name__ == "__main__":
    entry()
