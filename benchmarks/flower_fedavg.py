"""FedAvg on Flower's simulation engine, on the benchmark workload (optional variant).

Needs only ``torch`` and ``flwr[simulation]`` (not splitfed), so it can run under another
interpreter: ``python -m benchmarks.flower_fedavg --data W.pt --rounds R --out T.json``
with the repository root on ``PYTHONPATH`` (Flower's Ray workers import this module to
find the client app). ``W.pt`` is written by :meth:`benchmarks.workload.Workload.save`.

The client is written as Flower's PyTorch quickstart writes it: a fresh LeNet-5 loaded
from the received arrays, ``torch.optim.SGD``, K steps of ``zero_grad``/``backward``/
``step`` over the client's shuffled samples, the new arrays and ``num-examples`` sent
back; the server runs Flower's own ``FedAvg`` strategy (weighted by ``num-examples``) with
every node training each round and no evaluation. A round is timed from the strategy's
``configure_train`` to the end of its ``aggregate_train``; round 1 starts the Ray actors
and is the warm-up. Each actor gets ``--num-cpus`` CPUs (1: as many actors in parallel as
there are cores, one torch thread each).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

_CACHE: dict[str, dict] = {}


def lenet5() -> nn.Module:
    """The same LeNet-5 as ``splitfed.models.lenet5`` for 1x28x28 inputs, 10 classes."""
    return nn.Sequential(OrderedDict(
        conv1=nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(inplace=True),
                            nn.MaxPool2d(2)),
        conv2=nn.Sequential(nn.Conv2d(6, 16, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2)),
        fc1=nn.Sequential(nn.Flatten(), nn.Linear(400, 120), nn.ReLU(inplace=True)),
        fc2=nn.Sequential(nn.Linear(120, 84), nn.ReLU(inplace=True)),
        fc3=nn.Linear(84, 10),
    ))


def workload(path: str) -> dict:
    """The saved workload, loaded once per process (as Flower examples cache data sets)."""
    if path not in _CACHE:
        _CACHE[path] = torch.load(path)
    return _CACHE[path]


def build_apps(data_path: str, clients: int, rounds: int, times: list):
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg

    client_app = ClientApp()

    @client_app.train()
    def train(msg, context):
        w = workload(data_path)
        idx = w["parts"][int(context.node_config["partition-id"])]
        model = lenet5()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=float(msg.content["config"]["lr"]))
        order = idx[torch.randperm(len(idx))]
        b, total = w["batch"], 0.0
        for k in range(w["local_steps"]):
            rows = order[k * b:(k + 1) * b]
            opt.zero_grad()
            loss = F.cross_entropy(model(w["x"][rows]), w["y"][rows])
            loss.backward()
            opt.step()
            total += loss.item()
        metrics = MetricRecord({"train_loss": total / w["local_steps"],
                                "num-examples": len(idx)})
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
        return Message(content=content, reply_to=msg)

    class TimedFedAvg(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            times.append(["start", server_round, time.perf_counter()])
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            out = super().aggregate_train(server_round, replies)
            times.append(["end", server_round, time.perf_counter()])
            return out

    server_app = ServerApp()

    @server_app.main()
    def main(grid, context):
        w = workload(data_path)
        strategy = TimedFedAvg(fraction_train=1.0, fraction_evaluate=0.0,
                               min_train_nodes=clients, min_available_nodes=clients)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(w["seed"])
            initial = ArrayRecord(lenet5().state_dict())
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds,
                       train_config=ConfigRecord({"lr": float(w["lr"])}))

    return server_app, client_app


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--rounds", type=int, default=4, help="rounds, the first is warm-up")
    ap.add_argument("--num-cpus", type=float, default=1.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    from flwr.simulation import run_simulation

    # Import this module by name so Ray workers import it too (and share its cache)
    # instead of unpickling copies of functions defined in __main__.
    from benchmarks import flower_fedavg as mod

    clients = len(mod.workload(args.data)["parts"])
    times: list = []
    server_app, client_app = mod.build_apps(args.data, clients, args.rounds, times)
    t0 = time.perf_counter()
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=clients,
                   backend_config={"client_resources": {"num_cpus": args.num_cpus,
                                                        "num_gpus": 0.0}})
    start = {r: t for kind, r, t in times if kind == "start"}
    end = {r: t for kind, r, t in times if kind == "end"}
    import flwr
    result = {"flwr": flwr.__version__, "torch": torch.__version__,
              "num_cpus_per_client": args.num_cpus, "total_s": time.perf_counter() - t0,
              "round_s": {r: end[r] - start[r] for r in sorted(end)}}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
